"""The ``triton`` quant kernel: weight-only layers on NVIDIA GPUs, the weight read packed and
dequantized tile by tile inside one Triton GEMM (``triton_gemm.py``), for every weight form
of ``vframe.quant.kernels``:

* integers (GPTQ, AWQ, compressed-tensors W4A16 / W8A16): 4-bit weights two a byte, 8-bit
  one, float32 scales and offsets per group, any group size, act order (``g_idx``, also
  per output row) read as each input's group;
* FP8 e4m3 (``fp8`` on the fly, FP8 checkpoints, compressed-tensors FP8): the checkpoint's
  bytes and float32 scales per row or block;
* FP4 (NVFP4, MXFP4): the checkpoint's packed codes and scale bytes, the global scale per row.

What it computes is the ``reference`` kernel's: each weight dequantized in float32, rounded
to the activations' dtype, multiplied with float32 sums; only the order of the sums
differs. W8A8 layers (int8 activations) take ``int8_dynamic``, which runs on a GPU through
``torch._int_mm``; GGUF's int8-per-block activations are not run here.

On the CPU it runs only under ``TRITON_INTERPRET=1`` (Triton's interpreter, on CPU
tensors: how the tests check it, ``vframe.testing.check_quant_kernel("triton")``); a CPU
process without that variable never chooses it.
"""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType

import torch
from torch import nn

from vframe.errors import ModelLoadError
from vframe.quant.kernels import (
    FP8_E4M3, INT_WEIGHT, MXFP4, NVFP4, WEIGHT_ONLY, Fp4Weight, Fp8Weight, IntWeight, QuantLinearKernel,
    QuantLinearSpec,
)
from vframe.utils import triton_mode


@functools.cache
def _gemm() -> ModuleType:
    """The kernel module (imports Triton; refuses a ``TRITON_INTERPRET`` that changed since)."""
    return triton_mode.load_kernels("vframe.quant.kernels.triton_gemm")


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:  # [N, K] uint8 in [0, 16) -> [N, ceil(K / 2)]
    """Two 4-bit values a byte, input ``2j`` in the low nibble of byte ``j`` (an odd last
    input alone in its byte)."""
    if q.shape[1] % 2:
        q = torch.cat([q, q.new_zeros(q.shape[0], 1)], dim=1)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


class TritonKernel(QuantLinearKernel):
    """Weight-only layers on NVIDIA GPUs (see the module)."""

    priority = 25
    weight_types = (INT_WEIGHT, FP8_E4M3, NVFP4, MXFP4)

    @classmethod
    def check_available(cls) -> list[str]:
        return triton_mode.unavailable("it")

    @classmethod
    def can_implement(cls, spec: QuantLinearSpec) -> str | None:
        if spec.device.type != "cuda" and not (spec.device.type == "cpu" and triton_mode.interpreted()):
            return "it runs on NVIDIA GPUs (device 'cuda'); on the CPU only under TRITON_INTERPRET=1, for tests"
        if spec.activations != WEIGHT_ONLY:
            return "it runs weight-only layers only (activations in the model's dtype)"
        if spec.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return "it runs float32, bfloat16 and float16 activations only"
        if spec.weight_type == INT_WEIGHT and spec.bits not in (4, 8):
            return "it runs 4- and 8-bit integer weights only"
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not installed"
        return None

    def prepare(self, layer: nn.Module, weight: IntWeight | Fp8Weight | Fp4Weight) -> None:
        gemm = _gemm()
        where = self.spec.layer or "a quantized layer"
        self.has_offsets = self.has_groups = False  # buffers "offsets" (NVFP4: the global scales) and "groups"
        if isinstance(weight, Fp4Weight):
            nan = weight.scales == 0xFF if weight.format == MXFP4 else (weight.scales & 0x7F) == 0x7F
            if bool(nan.any()):
                raise ModelLoadError(f"{where}: a scale is NaN ({weight.format} byte)")
            self.fmt = gemm.FORMAT_NVFP4 if weight.format == NVFP4 else gemm.FORMAT_MXFP4
            self.bits, self.group_size = 4, weight.group_size
            self.buffer(layer, "q", weight.q.contiguous())  # the checkpoint's bytes: two codes each, as packed here
            self.buffer(layer, "scales", weight.scales.contiguous())
            if weight.format == NVFP4:
                self.buffer(layer, "offsets", weight.global_scale.float().contiguous())
                self.has_offsets = True
            return
        if isinstance(weight, Fp8Weight):
            q = weight.q.view(torch.uint8)
            if bool(((q & 0x7F) == 0x7F).any()):
                raise ModelLoadError(f"{where}: the FP8 weight holds NaN (e4m3 bytes 0x7F / 0xFF)")
            self.fmt, self.bits, self.group_size = gemm.FORMAT_FP8, 8, weight.group_size
            self.buffer(layer, "q", q.contiguous())
            self.buffer(layer, "scales", weight.scales.float().contiguous())
            return
        self.fmt, self.bits, self.group_size = gemm.FORMAT_INT, weight.bits, weight.group_size
        q = weight.q.to(torch.uint8)
        self.buffer(layer, "q", pack_nibbles(q) if weight.bits == 4 else q.contiguous())
        self.buffer(layer, "scales", weight.scales.float().contiguous())
        if weight.offsets is not None:
            self.buffer(layer, "offsets", weight.offsets.float().contiguous())
            self.has_offsets = True
        if weight.g_idx is not None:
            self.buffer(layer, "groups", weight.g_idx.to(torch.int32).contiguous())
            self.has_groups = True

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _gemm().dequantized_gemm(
            x, self.get(layer, "q"), self.get(layer, "scales"),
            self.get(layer, "offsets") if self.has_offsets else None,
            self.get(layer, "groups") if self.has_groups else None, bias,
            fmt=self.fmt, bits=self.bits, group_size=self.group_size,
        )  # fmt: skip

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        q, scales = self.get(layer, "q"), self.get(layer, "scales")
        gemm = _gemm()
        if self.fmt == gemm.FORMAT_NVFP4:
            return Fp4Weight(q, scales, self.get(layer, "offsets"), NVFP4).dequantize()
        if self.fmt == gemm.FORMAT_MXFP4:
            return Fp4Weight(q, scales, torch.ones(q.shape[0], device=q.device), MXFP4).dequantize()
        if self.fmt == gemm.FORMAT_FP8:
            return Fp8Weight(q, scales, self.group_size).dequantize()
        if self.bits == 4:
            q = torch.stack([q & 0x0F, q >> 4], dim=-1).flatten(1)[:, : self.spec.in_features]
        return IntWeight(
            self.bits, q, scales, self.get(layer, "offsets") if self.has_offsets else None, self.group_size,
            self.get(layer, "groups").long() if self.has_groups else None,
        ).dequantize()
