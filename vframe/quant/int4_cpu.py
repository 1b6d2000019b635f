"""torch's int4 weight-only CPU kernel (``torch._weight_int4pack_mm_for_cpu``)
for 4-bit formats with groups of consecutive inputs (GPTQ without act order, AWQ).

The kernel computes, per group of ``kernel_group_size`` inputs (32, 64, 128 or 256),
``W[o, i] = (q[o, i] - 8) * scale[g, o] + zero[g, o]``; a checkpoint's integer zero
point ``z`` (``W = scale * (q - z)``) becomes the float ``zero = scale * (8 - z)``.
Only bfloat16 activations run fast (float32 and float16 have no vectorised path);
outputs must be a multiple of 16.
"""

from __future__ import annotations

import torch
from torch import nn

_KERNEL_GROUP_SIZES = (256, 128, 64, 32)


def kernel_group_size(layer: nn.Module, group_size: int) -> int | None:
    """The kernel's group size for ``layer`` whose checkpoint groups are
    ``group_size`` consecutive inputs, or ``None`` where the kernel does not
    apply: not a bfloat16 model on the CPU, or sizes it cannot take. Kernel
    groups lie inside checkpoint groups (several share one scale)."""
    if layer.params_dtype != torch.bfloat16 or not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        return None
    if layer.output_size_per_partition % 16:
        return None
    inputs = layer.input_size_per_partition
    return next((size for size in _KERNEL_GROUP_SIZES if group_size % size == 0 and inputs % size == 0), None)


def pack(
    q: torch.Tensor,  # [out, in] int32 in [0, 16)
    scales: torch.Tensor,  # [groups, out] float
    zeros: torch.Tensor,  # [groups, out] int
    group_size: int,  # consecutive inputs per checkpoint group
    kernel_group_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's weight ([out, in / 2] uint8) and scales and zeros ([in / kernel group, out, 2] bfloat16)."""
    group = torch.arange(0, q.shape[1], kernel_group_size, device=q.device) // group_size  # of each kernel group
    scales = scales[group].float()
    scales_and_zeros = torch.stack([scales, scales * (8 - zeros[group]).float()], dim=-1)
    weight = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    return weight, scales_and_zeros.to(torch.bfloat16)


def matmul(
    x: torch.Tensor,  # [..., in] bfloat16
    weight: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    kernel_group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [..., out] bfloat16
    out = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]), weight, kernel_group_size, scales_and_zeros)
    out = out.view(*x.shape[:-1], -1)
    return out if bias is None else out + bias


def applies(x: torch.Tensor) -> bool:
    """Whether activations ``x`` take the kernel (bfloat16, on the CPU)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu"
