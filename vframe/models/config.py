"""A checkpoint's ``config.json`` as an attribute object, without importing transformers.

transformers' config classes pull in its model registry at import (about two
seconds of every start-up); vframe only needs the fields. Missing fields take
transformers' defaults for the model type, so a config that transformers reads
reads the same here (``tests/models/test_model_config.py`` compares them).

Every field vframe reads is checked against ``FIELD_RULES`` when the file is read,
so a broken ``config.json`` fails there, naming the file, the field, the value and
what is allowed, not later inside the model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vframe.errors import ModelLoadError


@dataclass(frozen=True)
class FieldRule:
    """What one ``config.json`` field may hold. ``low`` and ``high`` are inclusive
    bounds of numbers; ``null`` is allowed only if ``optional``."""

    kind: type  # int, float (any JSON number), bool, str, list or dict
    low: float | None = None
    high: float | None = None
    positive: bool = False  # a float that must be > 0
    optional: bool = False
    hint: str | None = None  # what is allowed, where the kind says too little
    items: type | None = None  # of a list: every item is a non-empty value of this type

    def allows(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if isinstance(value, bool) != (self.kind is bool):
            return False  # JSON true is not the integer 1, nor 1 a boolean
        if not isinstance(value, (int, float) if self.kind is float else self.kind):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False  # Python's json reads NaN and Infinity
        if self.items is not None and not all(isinstance(item, self.items) and item for item in value):
            return False
        if self.positive and value <= 0:
            return False
        if self.low is not None and value < self.low:
            return False
        return self.high is None or value <= self.high

    def describe(self) -> str:
        if self.hint:
            return self.hint
        text = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object"}[self.kind]
        if self.low is not None and self.high is not None:
            text += f" from {self.low} to {self.high}"
        elif self.positive:
            text += " greater than 0" + (f" and at most {self.high}" if self.high is not None else "")
        return text + (" or null" if self.optional else "")


# Every field vframe's models read. The bounds are far above any released model
# (the largest vocabularies are ~256k, contexts ~10M) and catch typos and unit slips
# before they become an out-of-memory error or a crash inside the model.
FIELD_RULES: dict[str, FieldRule] = {
    "architectures": FieldRule(list, items=str, optional=True, hint='a list of class names, e.g. ["LlamaForCausalLM"]'),
    "model_type": FieldRule(str),
    "vocab_size": FieldRule(int, 1, 2**24),
    "hidden_size": FieldRule(int, 1, 2**16),
    "intermediate_size": FieldRule(int, 1, 2**18),
    "num_hidden_layers": FieldRule(int, 1, 1024),
    "num_attention_heads": FieldRule(int, 1, 1024),
    "num_key_value_heads": FieldRule(int, 1, 1024, optional=True),
    "head_dim": FieldRule(int, 1, 1024, optional=True),
    "max_position_embeddings": FieldRule(int, 1, 2**24),
    "sliding_window": FieldRule(int, 1, 2**24, optional=True),
    "rms_norm_eps": FieldRule(float, high=1, positive=True),
    "rope_theta": FieldRule(float, positive=True),
    "rope_scaling": FieldRule(dict, optional=True),
    "rope_parameters": FieldRule(dict, optional=True),
    "hidden_act": FieldRule(str),
    "tie_word_embeddings": FieldRule(bool),
    "attention_bias": FieldRule(bool),
    "mlp_bias": FieldRule(bool),
}

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

# Per family: transformers' defaults for the model types each model module serves,
# and rules for the fields only that family reads (merged into FIELD_RULES).
_QWEN2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    # sliding_window applies only with use_sliding_window (vframe/models/qwen.py).
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "layer_types": None,
    "bos_token_id": None,
    "eos_token_id": None,
}
_QWEN_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": _QWEN2_DEFAULTS,
    "qwen3": _QWEN2_DEFAULTS | {"head_dim": 128, "attention_bias": False},
}
_QWEN_RULES: dict[str, FieldRule] = {
    "use_sliding_window": FieldRule(bool),
    "max_window_layers": FieldRule(int, 0, 1024),
    "layer_types": FieldRule(
        list, items=str, optional=True, hint='a list of "full_attention" or "sliding_attention", one per layer'
    ),
}
_MIXTRAL_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": _LLAMA_DEFAULTS | {
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_jitter_noise": 0.0,  # training only
    },
}
# 1 <= num_experts_per_tok <= num_local_experts: checked by the model (vframe/models/mixtral.py).
_MIXTRAL_RULES: dict[str, FieldRule] = {
    "num_local_experts": FieldRule(int, 1, 2**16),
    "router_jitter_noise": FieldRule(float, 0, 1),
}
_DEEPSEEK_V2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
    "first_k_dense_replace": 0, "kv_lora_rank": 512, "q_lora_rank": 1536, "n_group": None, "n_routed_experts": 64,
    "n_shared_experts": 2, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "routed_scaling_factor": 1.0,
    "topk_group": None, "topk_method": "greedy", "norm_topk_prob": False, "v_head_dim": 128,
    "num_experts_per_tok": None, "moe_intermediate_size": 1407,
}
_DEEPSEEK_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": _DEEPSEEK_V2_DEFAULTS,
    "deepseek_v3": {
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
        "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1,
        "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": None, "rope_interleave": True,
        "attention_bias": False, "mlp_bias": False, "num_nextn_predict_layers": 1,
    },
}
_DEEPSEEK_RULES: dict[str, FieldRule] = {
    "kv_lora_rank": FieldRule(int, 1, 2**16, optional=True),  # null: not an MLA model
    "q_lora_rank": FieldRule(int, 1, 2**16, optional=True),
    "qk_nope_head_dim": FieldRule(int, 1, 1024),
    "qk_rope_head_dim": FieldRule(int, 2, 1024),
    "v_head_dim": FieldRule(int, 1, 1024),
    "n_routed_experts": FieldRule(int, 1, 2**16),
    "n_shared_experts": FieldRule(int, 0, 1024, optional=True),
    "moe_intermediate_size": FieldRule(int, 1, 2**18),
    "num_experts_per_tok": FieldRule(int, 1, 1024, optional=True),
    "first_k_dense_replace": FieldRule(int, 0, 1024, optional=True),
    "n_group": FieldRule(int, 1, 2**16, optional=True),
    "topk_group": FieldRule(int, 1, 2**16, optional=True),
    "topk_method": FieldRule(str, optional=True, hint='"greedy", "group_limited_greedy" (DeepSeek-V2) or null'),
    "norm_topk_prob": FieldRule(bool, optional=True),
    "routed_scaling_factor": FieldRule(float, positive=True),
    "rope_interleave": FieldRule(bool, optional=True),
    "num_nextn_predict_layers": FieldRule(int, 0, 1024),
}

_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA_DEFAULTS,
    "mistral": _LLAMA_DEFAULTS
    | {"intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32},
    **_QWEN_DEFAULTS,
    **_MIXTRAL_DEFAULTS,
    **_DEEPSEEK_DEFAULTS,
}
FIELD_RULES.update(_QWEN_RULES | _MIXTRAL_RULES | _DEEPSEEK_RULES)


class ModelConfig:
    """Fields of ``config.json`` as attributes, defaults filled in for known model types."""

    def __init__(self, data: dict[str, Any], source: str | Path = "config.json") -> None:
        """``source`` names the file in error messages."""
        _check_fields(data, source)
        self.__dict__.update(_DEFAULTS.get(data.get("model_type", ""), {}))
        self.__dict__.update(data)
        if "rope_parameters" not in data and "rope_theta" in self.__dict__:
            # transformers >= 5 spelling, which the models read first.
            scaling = dict(self.__dict__.get("rope_scaling") or {})
            scaling.setdefault("rope_type", scaling.pop("type", "default"))
            self.rope_parameters = {"rope_theta": self.rope_theta, **scaling}
        heads = getattr(self, "num_attention_heads", None)
        if heads:
            if getattr(self, "num_key_value_heads", None) is None:
                self.num_key_value_heads = heads
            # MLA models (kv_lora_rank) cache a latent; their num_key_value_heads is unused.
            if heads % self.num_key_value_heads and not getattr(self, "kv_lora_rank", None):
                raise _invalid(source, "num_key_value_heads", self.num_key_value_heads,
                               f"a divisor of num_attention_heads={heads}")
            hidden = getattr(self, "hidden_size", None)
            if getattr(self, "head_dim", None) is None and hidden:
                if hidden % heads:
                    raise _invalid(source, "hidden_size", hidden,
                                   f"a multiple of num_attention_heads={heads}, or a head_dim field")
                self.head_dim = hidden // heads

    @classmethod
    def from_file(cls, path: Path, overrides: dict[str, Any] | None = None) -> ModelConfig:
        """``overrides`` (vLLM's ``hf_overrides``) replace fields of the file before
        it is checked; a dict merges into an object field (``rope_scaling``)."""
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: unreadable config ({e})") from e
        if not isinstance(data, dict):
            raise ModelLoadError(f"{path}: expected a JSON object")
        if "quantization_config" not in data and (path.parent / MODELOPT_QUANT_CONFIG).exists():
            data["quantization_config"] = _modelopt_quant_config(path.parent / MODELOPT_QUANT_CONFIG)
        if not overrides:
            return cls(data, path)
        return cls(_merged(data, overrides), f"{path} with hf_overrides")

    def __repr__(self) -> str:
        return f"ModelConfig({self.__dict__!r})"


# NVIDIA ModelOpt's own file beside config.json; older exports describe their quantization only there
MODELOPT_QUANT_CONFIG = "hf_quant_config.json"


def _modelopt_quant_config(path: Path) -> dict[str, Any]:
    """``hf_quant_config.json`` as the ``quantization_config`` of ``quant_method: modelopt``
    (what vLLM reads for a config.json without one; vframe.quant.modelopt parses it)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: unreadable ModelOpt quantization config ({e})") from e
    if not isinstance(data, dict) or not isinstance(data.get("quantization"), dict):
        raise ModelLoadError(f"{path}: expected a JSON object with a 'quantization' object, as ModelOpt writes it")
    return {"quant_method": "modelopt", **data}


def _merged(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(data)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def _invalid(source: str | Path, name: str, value: Any, expected: str) -> ModelLoadError:
    return ModelLoadError(f"{source}: invalid value for {name!r}: {json.dumps(value)} (expected {expected})")


def _check_fields(data: dict[str, Any], source: str | Path) -> None:
    for name, rule in FIELD_RULES.items():
        if name in data and not rule.allows(data[name]):
            raise _invalid(source, name, data[name], rule.describe())
