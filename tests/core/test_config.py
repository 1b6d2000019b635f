import pytest

from vframe.core.config import EngineConfig
from vframe.errors import ConfigError


def test_keyword_arguments_use_vllm_names_and_land_in_sections():
    cfg = EngineConfig.from_sources(env={}, max_num_seqs=8, block_size=32, dtype="float32", seed=3)
    assert cfg.scheduler.max_num_seqs == 8
    assert cfg.cache.block_size == 32
    assert cfg.model.dtype == "float32"
    assert cfg.model.seed == 3


def test_precedence_arguments_over_environment_over_file(tmp_path):
    f = tmp_path / "vframe.yaml"
    f.write_text("max_num_seqs: 4\nblock_size: 8\ncache:\n  enable_prefix_caching: false\n")
    env = {"VFRAME_MAX_NUM_SEQS": "6", "VFRAME_SWAP_SPACE": "1.5"}
    cfg = EngineConfig.from_sources(config_file=f, env=env, block_size=64)
    assert cfg.scheduler.max_num_seqs == 6  # env beats file
    assert cfg.cache.block_size == 64  # argument beats file
    assert cfg.cache.enable_prefix_caching is False  # from the file's section
    assert cfg.cache.swap_space == 1.5


def test_toml_file(tmp_path):
    f = tmp_path / "vframe.toml"
    f.write_text('attention_backend = "torch"\n[scheduler]\nmax_num_batched_tokens = 512\n')
    cfg = EngineConfig.from_sources(config_file=f, env={})
    assert cfg.attention.attention_backend == "torch"
    assert cfg.scheduler.max_num_batched_tokens == 512


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 0}, "invalid value for 'max_num_seqs': 0"),
        ({"dtype": "int8"}, "invalid value for 'dtype': 'int8'"),
        ({"block_size": 12}, "block_size must be a power of two, got 12"),
        ({"preemption_mode": "pause"}, "'recompute' or 'swap'"),
        ({"tensor_parallel_size": 0}, "invalid value for 'tensor_parallel_size': 0"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2: pipeline parallelism is not built yet"),
        ({"max_num_seq": 4}, "unknown setting 'max_num_seq'"),
    ],
)
def test_invalid_values_name_the_field_and_the_allowed_values(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig.from_sources(env={}, **kwargs)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        EngineConfig.from_sources(config_file=tmp_path / "nope.yaml", env={})


def test_auto_means_the_default_for_quantization_and_attention_backend():
    config = EngineConfig.from_sources(env={}, quantization="auto", attention_backend="auto")
    assert config.quantization.quantization is None
    assert config.attention.attention_backend is None
