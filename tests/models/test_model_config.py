"""vframe's config.json reader agrees with transformers' config classes and refuses
broken files by name."""

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config
from transformers import DeepseekV2Config, DeepseekV3Config

from vframe import LLM
from vframe.errors import ModelLoadError
from vframe.models.config import ModelConfig
from vframe.layers.rotary import rope_inv_freq
from vframe.models.llama import get_head_dim

FIELDS = [
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id",
]


@pytest.mark.parametrize(
    ("cls", "overrides"),
    [
        (LlamaConfig, {}),  # every default
        (LlamaConfig, {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "tie_word_embeddings": True}),
        (LlamaConfig, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
        (MistralConfig, {"sliding_window": 4096}),
        (MixtralConfig, {}),  # its MoE fields: tests/models/test_mixtral.py
        (Qwen2Config, {}),
        (Qwen2Config, {"num_key_value_heads": 4, "tie_word_embeddings": True, "rope_parameters": {"rope_theta": 1e6}}),
        (Qwen3Config, {}),  # head_dim 128, not hidden_size / heads
        (Qwen3Config, {"head_dim": 64, "attention_bias": True, "rope_parameters": {"rope_theta": 1e6}}),
        (DeepseekV2Config, {}),  # its MLA and MoE fields: tests/models/test_deepseek.py
        (DeepseekV3Config, {}),
    ],
)
def test_fields_match_transformers(tmp_path, cls, overrides):
    ref = cls(**overrides)
    ref.save_pretrained(tmp_path)
    ours = ModelConfig.from_file(tmp_path / "config.json")
    for name in FIELDS:
        # Mistral and Qwen2 have no bias fields: both sides fall back to "no bias".
        assert getattr(ours, name, False) == getattr(ref, name, False), name
    assert get_head_dim(ours) == get_head_dim(ref)
    assert rope_inv_freq(ours, get_head_dim(ours)).tolist() == rope_inv_freq(ref, get_head_dim(ref)).tolist()


def test_sparse_config_json_takes_transformers_defaults(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}))
    ours = ModelConfig.from_file(tmp_path / "config.json")
    ref = LlamaConfig(hidden_size=64, num_attention_heads=4)
    for name in FIELDS:
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.head_dim == 16
    assert rope_inv_freq(ours, 16).tolist() == rope_inv_freq(ref, 16).tolist()


# --------------------------------------------------------------------------- #
# A broken config.json fails when it is read, naming file, field, value and rule
# --------------------------------------------------------------------------- #

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}

BROKEN = [
    ("hidden_size", "abc", """'hidden_size': "abc" (expected an integer from 1 to 65536)"""),
    ("vocab_size", 1e10, "'vocab_size': 10000000000.0 (expected an integer from 1 to 16777216)"),
    ("vocab_size", 2**24 + 1, "'vocab_size': 16777217 (expected an integer from 1 to 16777216)"),
    ("max_position_embeddings", 0, "'max_position_embeddings': 0 (expected an integer from 1 to 16777216)"),
    ("architectures", "LlamaForCausalLM",
     """'architectures': "LlamaForCausalLM" (expected a list of class names, e.g. ["LlamaForCausalLM"])"""),
    ("architectures", [None], """'architectures': [null] (expected a list of class names, e.g. ["LlamaForCausalLM"])"""),
    ("num_hidden_layers", True, "'num_hidden_layers': true (expected an integer from 1 to 1024)"),
    ("num_attention_heads", None, "'num_attention_heads': null (expected an integer from 1 to 1024)"),
    ("head_dim", -64, "'head_dim': -64 (expected an integer from 1 to 1024 or null)"),
    ("tie_word_embeddings", "false", """'tie_word_embeddings': "false" (expected true or false)"""),
    ("rms_norm_eps", 0, "'rms_norm_eps': 0 (expected a number greater than 0 and at most 1)"),
    ("rope_theta", float("inf"), "'rope_theta': Infinity (expected a number greater than 0)"),
    ("rope_scaling", "linear", """'rope_scaling': "linear" (expected an object or null)"""),
    ("num_key_value_heads", 3, "'num_key_value_heads': 3 (expected a divisor of num_attention_heads=4)"),
    ("hidden_size", 66, "'hidden_size': 66 (expected a multiple of num_attention_heads=4, or a head_dim field)"),
]


def write_model_dir(path: Path, config: dict) -> Path:
    """A model directory: this config.json and a one-tensor safetensors file."""
    from safetensors.torch import save_file

    (path / "config.json").write_text(json.dumps(config))
    save_file({"x": torch.zeros(2)}, str(path / "model.safetensors"))
    return path / "config.json"


@pytest.mark.parametrize(("field", "value", "message"), BROKEN, ids=[f"{f}={v!r}" for f, v, _ in BROKEN])
def test_broken_config_json_names_file_field_value_and_rule(tmp_path, field, value, message):
    path = write_model_dir(tmp_path, TINY_LLAMA | {field: value})
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_file(path)
    assert str(info.value) == f"{path}: invalid value for {message}"


@pytest.mark.parametrize(("field", "value", "message"), BROKEN[:5], ids=[f for f, _, _ in BROKEN[:5]])
def test_llm_on_a_broken_config_json_raises_the_named_error(tmp_path, field, value, message):
    path = write_model_dir(tmp_path, TINY_LLAMA | {field: value})
    with pytest.raises(ModelLoadError) as info:
        LLM(model=str(tmp_path))
    assert str(info.value) == f"{path}: invalid value for {message}"


def test_explicit_head_dim_need_not_divide_hidden_size(tmp_path):
    path = write_model_dir(tmp_path, TINY_LLAMA | {"hidden_size": 66, "head_dim": 16})
    assert ModelConfig.from_file(path).head_dim == 16


def test_mla_config_ignores_num_key_value_heads(tmp_path):
    # transformers' DeepseekV3Config keeps num_key_value_heads=128 whatever the
    # head count; MLA never reads it, so a tiny config with 4 heads must load.
    from transformers import DeepseekV3Config

    DeepseekV3Config(hidden_size=64, num_attention_heads=4, kv_lora_rank=32).save_pretrained(tmp_path)
    ours = ModelConfig.from_file(tmp_path / "config.json")
    assert (ours.num_attention_heads, ours.num_key_value_heads, ours.kv_lora_rank) == (4, 128, 32)
