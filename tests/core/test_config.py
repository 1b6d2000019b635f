import pytest
import torch

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


def test_gpu_batch_defaults_are_vllms() -> None:
    from vframe.core.config import gpu_batch_defaults

    gib = 1 << 30
    # (max_num_batched_tokens, max_num_seqs), offline then server
    assert gpu_batch_defaults("NVIDIA H100 80GB HBM3", 80 * gib, server=False) == (16384, 1024)
    assert gpu_batch_defaults("NVIDIA H100 80GB HBM3", 80 * gib, server=True) == (8192, 1024)
    assert gpu_batch_defaults("NVIDIA H200", 141 * gib, server=False) == (16384, 1024)
    assert gpu_batch_defaults("NVIDIA A100-SXM4-80GB", 80 * gib, server=False) == (8192, 256)
    assert gpu_batch_defaults("NVIDIA A100-SXM4-80GB", 80 * gib, server=True) == (2048, 256)
    assert gpu_batch_defaults("NVIDIA B200", 180 * gib, server=True) == (16384, 1024)
    assert gpu_batch_defaults("NVIDIA L4", 24 * gib, server=False) == (8192, 256)


def _engine_on(config, name: str, memory: int):
    """What LLMEngine._apply_gpu_batch_defaults reads, for a runner on a GPU of this size."""
    from types import SimpleNamespace

    info = SimpleNamespace(device=torch.device("cuda", 0), device_name=name, device_memory=memory)
    return SimpleNamespace(config=config, runner_info=info)


def test_gpu_batch_defaults_fill_only_what_the_user_left_unset() -> None:
    from vframe.core.engine import LLMEngine

    h100 = ("NVIDIA H100 80GB HBM3", 80 << 30)
    config = EngineConfig.from_sources()
    LLMEngine._apply_gpu_batch_defaults(_engine_on(config, *h100))
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (1024, 16384)

    config = EngineConfig.from_sources(max_num_seqs=64)
    LLMEngine._apply_gpu_batch_defaults(_engine_on(config, *h100))
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (64, 16384)

    config = EngineConfig.from_sources(max_num_batched_tokens=2048, enable_chunked_prefill=True)
    config._usage = "server"
    LLMEngine._apply_gpu_batch_defaults(_engine_on(config, *h100))
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (1024, 2048)

    # without chunked prefill the engine's own rule (at least max_model_len) sets the budget later
    config = EngineConfig.from_sources(enable_chunked_prefill=False)
    LLMEngine._apply_gpu_batch_defaults(_engine_on(config, *h100))
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (1024, None)

    config = EngineConfig.from_sources()  # the CPU: nothing changes
    cpu = _engine_on(config, "", 0)
    cpu.runner_info.device = torch.device("cpu")
    LLMEngine._apply_gpu_batch_defaults(cpu)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (256, None)


def test_runner_info_of_a_cuda_runner_reads_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # RunnerInfo.of runs at every engine start on CUDA; it once raised NameError there (no GPU in CI),
    # so the one GPU query is stood in for here and the rest is the real code path.
    from types import SimpleNamespace

    from vframe.core.interfaces import RunnerInfo

    asked = []

    def properties(device):  # type: ignore[no-untyped-def]
        asked.append(device)
        return SimpleNamespace(name="NVIDIA H200", total_memory=141 << 30)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    runner = SimpleNamespace(
        resolved=None, hf_config=None, vocab_size=512, max_position_embeddings=2048,
        device=torch.device("cuda", 0), dtype=torch.bfloat16,
    )  # fmt: skip
    info = RunnerInfo.of(runner)
    assert asked == [torch.device("cuda", 0)]
    assert (info.device_name, info.device_memory, info.uses_kv_cache) == ("NVIDIA H200", 141 << 30, True)
