"""vframe's config.json reader agrees with transformers' config classes."""

import json

import pytest
from transformers import LlamaConfig, MistralConfig

from vframe.models.config import ModelConfig
from vframe.models.llama import get_head_dim, rope_inv_freq

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
    ],
)
def test_fields_match_transformers(tmp_path, cls, overrides):
    ref = cls(**overrides)
    ref.save_pretrained(tmp_path)
    ours = ModelConfig.from_file(tmp_path / "config.json")
    for name in FIELDS:
        # Mistral has no bias fields: both sides fall back to "no bias".
        assert getattr(ours, name) == getattr(ref, name, False), name
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
