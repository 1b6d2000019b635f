"""torch's int4 weight-only CPU kernel (``torch._weight_int4pack_mm_for_cpu``):
the ``int4_cpu`` quant kernel and the GGUF formats' Q4 segments and Q8_0 head.

The kernel computes, per group of ``kernel_group_size`` inputs (32, 64, 128 or 256),
``W[o, i] = (q[o, i] - 8) * scale[g, o] + zero[g, o]``: an ``IntWeight``'s scales
and offsets.
Only bfloat16 activations run fast (float32 and float16 have no vectorised path);
outputs must be a multiple of 16.

From ``PREFILL_ROWS`` rows (prefills) ``matmul`` dequantizes the weight to bfloat16 with
vframe's operator (``int4pack_dequantize``, exactly the kernel's values rounded to
bfloat16) and runs one bfloat16 GEMM: at 256 rows of [576 -> 1536] 1.55 ms against the
kernel's 2.64 (AMD Zen 4, 2 threads); below about 128 rows the kernel is faster.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from vframe.quant.kernels import IntWeight

_KERNEL_GROUP_SIZES = (256, 128, 64, 32)
PREFILL_ROWS = 128  # from here a bfloat16 GEMM over the dequantized weight beats the kernel


def group_for(inputs: int, group_size: int) -> int | None:
    """The kernel's group size for checkpoint groups of ``group_size`` consecutive
    inputs over ``inputs``, or ``None``: kernel groups lie inside checkpoint groups
    (several share one scale) and tile the inputs."""
    return next((size for size in _KERNEL_GROUP_SIZES if group_size % size == 0 and inputs % size == 0), None)


def kernel_group_size(layer: nn.Module, group_size: int) -> int | None:
    """``group_for`` for ``layer`` , or ``None`` where the kernel does not apply:
    not a bfloat16 model on the CPU, or outputs not a multiple of 16."""
    if layer.params_dtype != torch.bfloat16 or not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        return None
    if layer.output_size_per_partition % 16:
        return None
    return group_for(layer.input_size_per_partition, group_size)


def pack(weight: IntWeight, kernel_group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's weight ([out, in / 2] uint8) and scales and zeros ([in / kernel
    group, out, 2] bfloat16) of a 4-bit ``weight`` with consecutive groups."""
    group = torch.arange(0, weight.q.shape[1], kernel_group_size, device=weight.q.device) // weight.group_size
    scales = weight.scales[:, group].T.float()  # [kernel groups, out]
    zeros = torch.zeros_like(scales) if weight.offsets is None else weight.offsets[:, group].T.float()
    packed = torch._convert_weight_to_int4pack_for_cpu(weight.q.int().contiguous(), 1)
    return packed, torch.stack([scales, zeros], dim=-1).to(torch.bfloat16)


def unpack(weight: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_group_size: int) -> torch.Tensor:
    """The kernel's float32 weight [out, in], exactly: the product with an identity in float32."""
    inputs = scales_and_zeros.shape[0] * kernel_group_size
    eye = torch.eye(inputs, device=weight.device)
    return torch._weight_int4pack_mm_for_cpu(eye, weight, kernel_group_size, scales_and_zeros.float()).T


def matmul(
    x: torch.Tensor,  # [..., in] bfloat16
    weight: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    kernel_group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [..., out] bfloat16
    rows = x.reshape(-1, x.shape[-1])
    dequantize = _dequantizer() if rows.shape[0] >= PREFILL_ROWS and weight.shape[0] % 64 == 0 else None
    if dequantize is not None:
        out = torch.nn.functional.linear(rows, dequantize(weight, scales_and_zeros, kernel_group_size))
    else:
        out = torch._weight_int4pack_mm_for_cpu(rows, weight, kernel_group_size, scales_and_zeros)
    out = out.view(*x.shape[:-1], -1)
    return out if bias is None else out + bias


@functools.cache
def _dequantizer() -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None:
    """vframe's ``int4pack_dequantize`` operator, or ``None`` where it cannot be built here."""
    from vframe.quant.kernels.builtin import _woq_ops, woq_cpu_available

    return None if woq_cpu_available() is not None else _woq_ops().int4pack_dequantize


def applies(x: torch.Tensor) -> bool:
    """Whether activations ``x`` take the kernel (bfloat16, on the CPU)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu"
