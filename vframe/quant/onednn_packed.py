"""Unquantized float32 and bfloat16 linear weights on the CPU, prepacked once for oneDNN
(bfloat16 on a CPU with AVX512-BF16 is held as pairs for vframe's own ``bf16_gemm``
instead: ``vframe/layers/cpu_ops.py``, ``UnquantizedLinearMethod``).

``F.linear`` on a bfloat16 CPU tensor calls oneDNN, which reorders the weight
into its blocked layout on every call. Reordering once after loading
(``torch.ops.mkldnn._reorder_linear_weight``) and multiplying with
``torch.ops.mkldnn._linear_pointwise`` gives the same numbers (the same oneDNN
kernel; bit-identical in the tests) without the per-call copy: on AMD Zen 4, one
thread, a [1, 576] x [576, 3072] product took 0.069 ms against 0.140 ms, [32, 576]
0.52 ms against 0.60 ms; from a few hundred rows on, both are the same.

float32 ``F.linear`` calls MKL instead, which on AMD CPUs runs below the machine:
on an AVX2 AMD EPYC, two threads, the products of one SmolLM2 decode step of 64 rows
took 194 ms in MKL and 141 ms in oneDNN's packed float32 kernel, the
[64, 576] x [576, 49152] LM head 66 ms against 32 ms (``benchmarks/linear_fp32.py``;
there each weight stays in cache), and a whole batch-1 decode step, which streams
every weight from memory, 75-81 ms against 55-61 ms. So float32 weights are packed
too, on x86-64 CPUs; the two libraries sum in different orders, so results differ in
float32's last bits (within the parity tests' tolerances). float16 has no native oneDNN path on most CPUs and is
left alone. The packed weight replaces the plain one (an opaque
``torch._mkldnn`` tensor: no ``data_ptr``, ``to_dense()`` gives the plain weight
back exactly), so memory does not grow. A layer that reads its weight directly
sets ``needs_plain_weight = True`` and is left alone; ``VFRAME_ONEDNN_PACKED_WEIGHTS=0``
turns packing off (to measure it). A tied LM head gets a packed copy of its own
(the embedding keeps the plain rows it looks up): vocab x hidden more bytes, 56 MiB
for SmolLM2 in bfloat16 (113 MiB in float32), for a head 2.8x faster at one row
([1, 576] x [576, 49152], bfloat16: 3.7 ms against 10.3 ms).
"""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Callable

import torch
from torch import nn

from vframe.quant.native_call import NativeCall, with_native


@functools.cache
def onednn_fp32_available() -> bool:
    """oneDNN's float32 products on this CPU (x86-64 builds of torch with oneDNN)."""
    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()


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
        and not getattr(layer, "needs_plain_weight", False)
        and packable(weight)
    )


def packable(weight: torch.Tensor) -> bool:
    """``weight`` is a plain float32 or bfloat16 CPU tensor that oneDNN multiplies natively
    here, and packing is not turned off."""
    return (
        weight.device.type == "cpu"
        and not weight.is_mkldnn
        and os.environ.get("VFRAME_ONEDNN_PACKED_WEIGHTS", "1") != "0"
        and (
            (weight.dtype == torch.bfloat16 and onednn_bf16_available())
            or (weight.dtype == torch.float32 and onednn_fp32_available())
        )
    )


def pack(layer: nn.Module) -> None:
    """Replace ``layer.weight`` ([out, in] float32 or bfloat16) by its oneDNN-packed form."""
    packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
    layer.weight = nn.Parameter(packed, requires_grad=False)


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as an ordinary tensor: a packed weight's plain form (exact), anything else itself."""
    return t.to_dense() if t.is_mkldnn else t


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def bound_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``packed_linear(x, weight, bias)`` as a function of ``x``, the operator looked up once."""
    op, args = torch.ops.mkldnn._linear_pointwise.default, (weight, bias, "none", [], "")

    def linear(x: torch.Tensor) -> torch.Tensor:
        return op(x, *args)

    return with_native(linear, NativeCall(op, args))
