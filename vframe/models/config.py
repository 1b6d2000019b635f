"""A checkpoint's ``config.json`` as an attribute object, without importing transformers.

transformers' config classes pull in its model registry at import (about two
seconds of every start-up); vframe only needs the fields. Missing fields take
transformers' defaults for the model type, so a config that transformers reads
reads the same here (``tests/models/test_config.py`` compares them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vframe.errors import ModelLoadError

_LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "sliding_window": None,
}

_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA_DEFAULTS,
    "mistral": _LLAMA_DEFAULTS
    | {"intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32},
}


class ModelConfig:
    """Fields of ``config.json`` as attributes, defaults filled in for known model types."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.__dict__.update(_DEFAULTS.get(data.get("model_type", ""), {}))
        self.__dict__.update(data)
        if "rope_parameters" not in data and "rope_theta" in self.__dict__:
            # transformers >= 5 spelling, which the models read first.
            scaling = dict(self.__dict__.get("rope_scaling") or {})
            scaling.setdefault("rope_type", scaling.pop("type", "default"))
            self.rope_parameters = {"rope_theta": self.rope_theta, **scaling}
        if getattr(self, "num_attention_heads", None):
            if getattr(self, "num_key_value_heads", None) is None:
                self.num_key_value_heads = self.num_attention_heads
            if getattr(self, "head_dim", None) is None and getattr(self, "hidden_size", None):
                self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: unreadable config ({e})") from e
        if not isinstance(data, dict):
            raise ModelLoadError(f"{path}: expected a JSON object")
        return cls(data)

    def __repr__(self) -> str:
        return f"ModelConfig({self.__dict__!r})"
