"""Tiny random Qwen2 / Qwen3 checkpoints written with transformers, for the tests of the
models (tests/models/test_qwen.py) and of the layers that run them (tests/backends)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 112
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def save_tiny_qwen(path: Path, config_cls_name: str, **overrides: object) -> torch.nn.Module:
    """A random checkpoint of transformers' ``Qwen2ForCausalLM`` or
    ``Qwen3ForCausalLM``, every bias drawn at random (transformers starts them at
    zero, and a model that dropped a zero bias would pass)."""
    import transformers

    config = getattr(transformers, f"{config_cls_name}Config")(**(TINY | overrides))
    torch.manual_seed(0)
    hf_model = getattr(transformers, f"{config_cls_name}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    hf_model.save_pretrained(str(path))
    return hf_model
