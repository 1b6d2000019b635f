"""Qwen2 and Qwen3: Llama (``vframe/models/llama.py``) with a different attention.

- Qwen2: biases on the q, k and v projections, none on o_proj or in the MLP.
- Qwen3: an RMSNorm over each head of q and of k (``q_norm``, ``k_norm``, over
  ``head_dim``) before rope; biases as Llama's (``attention_bias``, off by
  default); ``head_dim`` given explicitly (128 by default), not hidden / heads.

Both read attention windows as transformers does: ``sliding_window`` counts only
with ``use_sliding_window`` (off by default and in released checkpoints, which
still carry a ``sliding_window`` value), and then only on the layers that
``layer_types`` calls ``"sliding_attention"``: by default those from
``max_window_layers`` on.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from vframe.core.interfaces import AttentionBackend
from vframe.errors import ModelLoadError
from vframe.models.llama import LlamaAttention, LlamaForCausalLM, RMSNorm
from vframe.quant.base import QuantizationConfig

ARCHITECTURES = ["Qwen2ForCausalLM", "Qwen3ForCausalLM"]

# "attention" is transformers' legacy name of "full_attention".
_LAYER_TYPES = {"full_attention", "attention", "sliding_attention"}


def sliding_windows(hf_config: Any) -> list[int | None]:
    """Each layer's attention window (None: full attention)."""
    num_layers = hf_config.num_hidden_layers
    window = hf_config.sliding_window if getattr(hf_config, "use_sliding_window", False) else None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        first_windowed = hf_config.max_window_layers if window is not None else num_layers
        layer_types = ["full_attention" if i < first_windowed else "sliding_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers or not set(layer_types) <= _LAYER_TYPES:
        raise ModelLoadError(
            f"config.json: invalid value for 'layer_types': {json.dumps(layer_types)} (expected "
            f"num_hidden_layers={num_layers} entries, each \"full_attention\" or \"sliding_attention\")"
        )
    return [window if layer_type == "sliding_attention" else None for layer_type in layer_types]


def qwen_sliding_window(hf_config: Any, layer_idx: int) -> int | None:
    return sliding_windows(hf_config)[layer_idx]


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def projection_biases(hf_config: Any) -> tuple[bool, bool]:
        return True, False

    layer_sliding_window = staticmethod(qwen_sliding_window)


class Qwen3Attention(LlamaAttention):
    def __init__(
        self,
        hf_config: Any,
        attn_backend: type[AttentionBackend],
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
        layer_idx: int = 0,
    ) -> None:
        super().__init__(hf_config, attn_backend, dtype, quant_config, prefix, layer_idx)
        self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, dtype)

    layer_sliding_window = staticmethod(qwen_sliding_window)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # [T, H, D], [T, KVH, D]: each head on its own


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
