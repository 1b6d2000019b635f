"""Unquantized bfloat16 linear weights on the CPU, prepacked once for oneDNN.

``F.linear`` on a bfloat16 CPU tensor calls oneDNN, which reorders the weight
into its blocked layout on every call. Reordering once after loading
(``torch.ops.mkldnn._reorder_linear_weight``) and multiplying with
``torch.ops.mkldnn._linear_pointwise`` gives the same numbers (the same oneDNN
kernel; bit-identical in the tests) without the per-call copy: on AMD Zen 4, one
thread, a [1, 576] x [576, 3072] product took 0.069 ms against 0.140 ms, [32, 576]
0.52 ms against 0.60 ms; from a few hundred rows on, both are the same.

Only bfloat16 on CPUs where oneDNN runs it natively: float32 ``F.linear`` uses a
different BLAS whose rounding the parity tests pin, and float16 has no native
oneDNN path on most CPUs. The packed weight replaces the plain one (an opaque
``torch._mkldnn`` tensor: no ``data_ptr``, ``to_dense()`` gives the plain weight
back exactly), so memory does not grow. A layer that reads its weight directly
sets ``needs_plain_weight = True`` and is left alone; ``VFRAME_ONEDNN_PACKED_WEIGHTS=0``
turns packing off (to measure it). A tied LM head gets a packed copy of its own
(the embedding keeps the plain rows it looks up): vocab x hidden more bytes, 56 MiB
for SmolLM2, for a head 2.8x faster at one row ([1, 576] x [576, 49152]: 3.7 ms
against 10.3 ms).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn


@functools.cache
def onednn_bf16_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def should_pack(layer: nn.Module) -> bool:
    weight = getattr(layer, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and not weight.is_mkldnn
        and not getattr(layer, "needs_plain_weight", False)
        and os.environ.get("VFRAME_ONEDNN_PACKED_WEIGHTS", "1") != "0"
        and onednn_bf16_available()
    )


def pack(layer: nn.Module) -> None:
    """Replace ``layer.weight`` ([out, in] bfloat16) by its oneDNN-packed form."""
    packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
    layer.weight = nn.Parameter(packed, requires_grad=False)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
