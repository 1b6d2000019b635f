"""The built-in quantized linear kernels (see ``vframe.quant.kernels``)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vframe.quant import int4_cpu
from vframe.errors import ModelLoadError
from vframe.quant.base import BoundApply, NativeCall, with_native
from vframe.quant.kernels import (
    ACTIVATION_BLOCK, FP8_E4M3, INT8_PER_BLOCK, INT8_PER_TOKEN, INT_WEIGHT, LUT4, MXFP4, NVFP4, WEIGHT_ONLY, Fp4Weight,
    Fp8Weight, IntWeight, Lut4Weight, QuantLinearKernel, QuantLinearSpec,
)

INT8_MAX = 127


class ReferenceKernel(QuantLinearKernel):
    """Dequantize to float32, cast to the activations' dtype, ``F.linear``: every
    spec on every device, and the definition the others are checked against.
    Keeps the integers unpacked (one byte each)."""

    priority = 0
    weight_types = (INT_WEIGHT, FP8_E4M3, NVFP4, MXFP4, LUT4)
    int_bits = (4, 6, 8)

    @classmethod
    def can_implement(cls, spec: QuantLinearSpec) -> str | None:
        if spec.activations == INT8_PER_BLOCK and spec.in_features % ACTIVATION_BLOCK:
            return f"int8 activations per block of {ACTIVATION_BLOCK} need a multiple of {ACTIVATION_BLOCK} inputs"
        return None

    def prepare(self, layer: nn.Module, weight: IntWeight | Fp8Weight | Fp4Weight | Lut4Weight) -> None:
        if isinstance(weight, Fp4Weight):  # as the checkpoint packs it
            for name in ("q", "scales", "global_scale"):
                self.buffer(layer, name, getattr(weight, name).contiguous())
            return
        if isinstance(weight, Lut4Weight):
            for name in ("q", "scales", "table"):
                self.buffer(layer, name, getattr(weight, name).contiguous())
            self.group_size = weight.group_size
            return
        self.buffer(layer, "q", weight.q.to(torch.uint8).contiguous())
        self.buffer(layer, "scales", weight.scales.float().contiguous())
        self.group_size = weight.group_size
        if isinstance(weight, Fp8Weight):
            return
        if weight.offsets is not None:
            self.buffer(layer, "offsets", weight.offsets.float().contiguous())
        self.buffer(layer, "groups", weight.g_idx if weight.g_idx is not None else torch.empty(0, dtype=torch.long))
        self.bits = weight.bits

    def _weight(self, layer: nn.Module) -> IntWeight | Fp8Weight | Fp4Weight | Lut4Weight:
        if self.spec.weight_type == LUT4:
            return Lut4Weight(self.get(layer, "q"), self.get(layer, "scales"), self.get(layer, "table"),
                              self.group_size)
        if self.spec.weight_type in (NVFP4, MXFP4):  # the spec's weight type is the Fp4Weight's format
            return Fp4Weight(self.get(layer, "q"), self.get(layer, "scales"), self.get(layer, "global_scale"),
                             self.spec.weight_type)
        if self.spec.weight_type == FP8_E4M3:
            return Fp8Weight(self.get(layer, "q"), self.get(layer, "scales"), self.group_size)
        offsets = getattr(layer, f"{self.name}_offsets", None)
        groups = self.get(layer, "groups")
        return IntWeight(self.bits, self.get(layer, "q"), self.get(layer, "scales"), offsets, self.group_size,
                         groups if groups.numel() else None)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.spec.activations == INT8_PER_TOKEN:
            w = self._weight(layer)
            xq, x_scale = quantize_per_token(x)
            acc = xq.float() @ (w.q.float() - 128).T  # [T, out]
            return _scaled(acc, x_scale, w.scales[:, 0], x.dtype, bias)
        if self.spec.activations == INT8_PER_BLOCK:
            x = quantize_per_block(x).to(x.dtype)
        return F.linear(x, self.dequantize_weight(layer).to(x.dtype), bias)

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        return self._weight(layer).dequantize()


class Int8DynamicKernel(QuantLinearKernel):
    """W8A8: each token scaled to int8 by its own max |x| / 127, ``torch._int_mm``
    (exact int32 sums; oneDNN's VNNI path on the CPU), then both scales."""

    priority = 20

    @classmethod
    def can_implement(cls, spec: QuantLinearSpec) -> str | None:
        if spec.activations != INT8_PER_TOKEN:
            return "it runs int8 activations (W8A8) only"
        if spec.bits != 8 or not spec.symmetric or spec.group_size != spec.in_features or spec.act_order:
            return "it runs symmetric 8-bit weights with one scale per output channel only"
        if not hasattr(torch, "_int_mm"):
            return "this torch has no torch._int_mm"
        return None

    def prepare(self, layer: nn.Module, weight: IntWeight) -> None:
        self.buffer(layer, "weight", (weight.q.to(torch.int16) - 128).to(torch.int8).contiguous())  # [out, in]
        self.buffer(layer, "scale", weight.scales[:, 0].float().contiguous())  # [out]
        # On the CPU, woq_cpu's library does the steps below in one C++ call, bit for bit; with the
        # weight's row sums (int32 [out]) it multiplies decode-sized rows by AVX512-VNNI itself.
        self.one_call = self.spec.device.type == "cpu" and woq_cpu_available() is None
        if self.one_call:
            self.buffer(layer, "sums", self.get(layer, "weight").sum(dim=1, dtype=torch.int32))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = self.get(layer, "weight")
        if self.one_call:
            out = _woq_ops().int8_dynamic_mm(x, w, self.get(layer, "scale"), self.get(layer, "sums"))
            return out if bias is None else out + bias
        xq, x_scale = quantize_per_token(x)
        tokens, inputs = xq.shape
        # torch._int_mm on a GPU needs more than 16 rows and sizes that 8 divides; the CPU takes any.
        if x.device.type == "cpu" or (tokens > 16 and inputs % 8 == 0 and w.shape[0] % 8 == 0):
            acc = torch._int_mm(xq, w.T).float()  # [T, out], exact int32
        else:
            acc = xq.float() @ w.float().T
        return _scaled(acc, x_scale, self.get(layer, "scale"), x.dtype, bias)

    def bind(self, layer: nn.Module, bias: torch.Tensor | None) -> BoundApply | None:
        if not self.one_call:
            return None
        op, w, scale = _woq_ops().int8_dynamic_mm.default, self.get(layer, "weight"), self.get(layer, "scale")
        sums = self.get(layer, "sums")

        def product(x: torch.Tensor) -> torch.Tensor:
            out = op(x, w, scale, sums)
            return out if bias is None else out + bias

        return with_native(product, NativeCall(op, (w, scale, sums), bias))

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        return self.get(layer, "weight").float() * self.get(layer, "scale")[:, None]


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [T, in] and the float32 scale [T, 1] of each token (max |x| / 127)."""
    x_scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / INT8_MAX
    return torch.round(x.float() / x_scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), x_scale


def quantize_per_block(x: torch.Tensor) -> torch.Tensor:
    """``x`` [T, in] as ``INT8_PER_BLOCK`` activations stand for it, float32: each block
    of 32 inputs ``d * round(x * (1 / d))`` with ``d = max |x| / 127`` (0 for a block of
    zeros), rounded half to even; what ``woq_cpu_a8``'s C++ operator computes with."""
    blocks = x.float().reshape(*x.shape[:-1], -1, ACTIVATION_BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv).clamp(-INT8_MAX, INT8_MAX) * d).reshape(x.shape)


def _scaled(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype,
            bias: torch.Tensor | None) -> torch.Tensor:
    out = (acc * x_scale * w_scale).to(dtype)
    return out if bias is None else out + bias


class _Permuted(QuantLinearKernel):
    """Act-order weights with equal groups run as consecutive groups: the inputs
    are sorted by group once (the weight's columns) and on every call (the activations')."""

    @staticmethod
    def permutable(spec: QuantLinearSpec) -> str | None:
        if not spec.equal_groups:
            return f"its groups must each hold {spec.group_size} inputs, in the same order for every output"
        return None

    def _in_group_order(self, layer: nn.Module, weight: IntWeight) -> IntWeight:
        if weight.g_idx is None:
            self.permuted = False
            return weight
        perm = torch.argsort(weight.g_idx, stable=True)
        in_order = torch.arange(len(perm), device=perm.device) // weight.group_size
        assert torch.equal(weight.g_idx[perm], in_order), "can_implement checks equal_groups"
        self.permuted = True
        self.buffer(layer, "perm", perm)
        return IntWeight(weight.bits, weight.q[:, perm], weight.scales, weight.offsets, weight.group_size)

    def _inputs(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.get(layer, "perm")] if self.permuted else x

    def _columns_back(self, layer: nn.Module, w: torch.Tensor) -> torch.Tensor:  # [out, in] in group order
        if not self.permuted:
            return w
        out = torch.empty_like(w)
        out[:, self.get(layer, "perm")] = w
        return out


def woq_library():  # vframe.utils.native.NativeLibrary
    from vframe.layers.cpu_ops import BF16_TILE
    from vframe.utils.native import NativeLibrary

    source = Path(__file__).with_name("csrc") / "woq_gemm.cpp"
    return NativeLibrary("quant_cpu", (source,), "vframe_quant_cpu.so", "woq_cpu quantized matmul operators",
                         flags=("-ffp-contract=off",), headers=(BF16_TILE,))  # dequantization equal to PyTorch's


@functools.cache
def _woq_ops():
    woq_library().load()
    return torch.ops.vframe_quant_cpu


def woq_cpu_available() -> str | None:
    """``None`` when vframe's C++ weight-only kernel is built (or builds) here; else why not."""
    from vframe.utils.native import BuildError

    try:
        _woq_ops()
    except (BuildError, OSError, RuntimeError) as e:
        return f"its C++ operators could not be built here ({str(e).splitlines()[0]})"
    return None


class _DequantizedGemm:
    """A C++ kernel's two ways through ``apply``: up to ``MAX_ROWS`` activation rows its
    product in place (the operator ``_in_place_call`` names, which the kernel defines; ``bind``
    calls it with its tensors looked up once); more rows (prefill)
    times the weight dequantized into their dtype (``_dequantized``, also the kernel's), a
    block of output rows at a time where the whole would pass ``CHUNK_BYTES``: there
    oneDNN's GEMM is faster than any weight-only loop.

    The bound per activation dtype: bfloat16 / float16 GEMMs are 2-3x faster than
    float32 ones on CPUs with native bfloat16, so 16 rows there (measured on Zen 4); in
    float32 the dequantized GEMM catches up later (AVX2 EPYC, 2 threads, [M, 576] x
    [576 -> 1536] over 40 weights streamed from memory: 4 bit in place 1.30 ms against
    1.79 at 32 rows, 1.96 against 2.02 at 48; 8 bit 0.88 against 0.92 at 32)."""

    CHUNK_BYTES = 4 << 20  # most bytes of dequantized weight one GEMM reads
    MAX_ROWS = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16}

    @classmethod
    def check_available(cls) -> list[str]:
        reason = woq_cpu_available()
        return [reason] if reason else []

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] > self.MAX_ROWS[x.dtype]:
            out = self._dequantized_product(layer, self._gemm_inputs(x))
        else:
            out = self._in_place_product(layer, x)
        return out if bias is None else out + bias

    def bind(self, layer: nn.Module, bias: torch.Tensor | None) -> BoundApply | None:
        # Decode-sized activations straight to the operator, its tensors looked up once.
        op, args = self._in_place_call(layer)
        max_rows, apply = self.MAX_ROWS[self.spec.dtype], self.apply

        def product(x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > max_rows:
                return apply(layer, x, bias)
            out = op(x, *args, x.dtype)
            return out if bias is None else out + bias

        return with_native(product, NativeCall(op, (*args, self.spec.dtype), bias, max_rows))

    def _in_place_product(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        op, args = self._in_place_call(layer)
        return op(x, *args, x.dtype)

    def _in_place_call(self, layer: nn.Module) -> tuple[Callable[..., torch.Tensor], tuple]:
        """The C++ operator of the in-place product and its arguments between the
        activations and their dtype: ``op(x, *args, x.dtype)`` is ``x @ W.T``."""
        raise NotImplementedError

    def _gemm_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The activations as the dequantized GEMM takes them (the kernel's numerics)."""
        return x

    def _dequantized_product(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` through the weight dequantized into ``x``'s dtype: a weight of more
        than ``CHUNK_BYTES`` so dequantized (an LM head) a block of output rows at a time,
        so that its float copy stays in cache and never exists whole (the SmolLM2 Q8_0
        head, [64, 576] x [576 -> 49152] float32, 2 threads, AVX2 EPYC: 167 ms in one
        piece, 74 ms in blocks of 4 MiB, 92 ms of 8, 77 ms of 2)."""
        out_features, in_features = self.spec.out_features, self.spec.in_features
        rows = max(1, self.CHUNK_BYTES // (in_features * x.element_size()))
        if rows >= out_features:
            return F.linear(x, self._dequantized(layer, x.dtype))
        out = x.new_empty(x.shape[0], out_features)
        for start in range(0, out_features, rows):
            block = slice(start, min(start + rows, out_features))
            out[:, block] = F.linear(x, self._dequantized(layer, x.dtype, block))
        return out

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight as the kernel's own dequantization gives it, in float32."""
        return self._dequantized(layer, torch.float32)


class _PermutedGemm(_DequantizedGemm, _Permuted):
    """A ``_DequantizedGemm`` whose act-order weights hold their inputs in group order: ``apply``
    sorts the activations to match; ``bind`` leaves such layers to ``apply``."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return super().apply(layer, self._inputs(layer, x), bias)  # the inputs in group order

    def bind(self, layer: nn.Module, bias: torch.Tensor | None) -> BoundApply | None:
        return None if self.permuted else super().bind(layer, bias)  # act order: apply sorts the inputs


class WoqCpuKernel(_PermutedGemm):
    """vframe's C++ kernel (``csrc/woq_gemm.cpp``): up to ``MAX_ROWS`` activation
    rows are multiplied by the integers in place (8 bit: a byte each; 4 bit: two
    per byte), more rows dequantize the weight into the activations' dtype for one
    GEMM (prefill)."""

    priority = 20

    @classmethod
    def can_implement(cls, spec: QuantLinearSpec) -> str | None:
        if spec.device.type != "cpu":
            return "it runs on the CPU only"
        if spec.activations != WEIGHT_ONLY:
            return "it runs weight-only formats only"
        if spec.bits not in (4, 8):
            return "it runs 4 and 8 bit weights only"
        if spec.in_features % spec.group_size or spec.group_size % 2:
            return f"it needs even groups that divide the {spec.in_features} inputs"
        if spec.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return "it runs float32, bfloat16 and float16 activations only"
        return cls.permutable(spec) or woq_cpu_available()

    def prepare(self, layer: nn.Module, weight: IntWeight) -> None:
        weight = self._in_group_order(layer, weight)
        self.bits, self.group_size = weight.bits, weight.group_size
        q = weight.q.to(torch.uint8)
        if self.bits == 4:  # byte j of a group: input j (low nibble) and input j + group / 2 (high)
            halves = q.view(q.shape[0], -1, 2, self.group_size // 2)
            q = (halves[:, :, 0] | (halves[:, :, 1] << 4)).flatten(1)
        self.buffer(layer, "q", q.contiguous())
        self.buffer(layer, "scales", weight.scales.float().contiguous())
        # The operator subtracts s (z - mid) = -offset times each group's input sum.
        neg_offsets = torch.empty(0) if weight.offsets is None else -weight.offsets.float().contiguous()
        self.buffer(layer, "neg_offsets", neg_offsets)

    def _in_place_call(self, layer: nn.Module) -> tuple[Callable[..., torch.Tensor], tuple]:
        # woq_gemm reads bfloat16 x as it is (4 bit, AVX512-BF16), else as float32
        return _woq_ops().woq_gemm.default, self._woq_args(layer)

    def _woq_args(self, layer: nn.Module) -> tuple:
        return (self.get(layer, "q"), self.get(layer, "scales"), self.get(layer, "neg_offsets"),
                self.group_size, self.bits)

    def _dequantized(
        self, layer: nn.Module, dtype: torch.dtype, rows: torch.Tensor | slice | None = None
    ) -> torch.Tensor:
        """Output rows ``rows`` (all: None) of the weight in ``dtype``, the inputs in group
        order: the C++ operator's one pass, bit for bit ``IntWeight.dequantize`` then cast."""
        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if rows is None or t.numel() == 0 else t[rows]

        q, scales, neg_offsets = (pick(self.get(layer, name)) for name in ("q", "scales", "neg_offsets"))
        return _woq_ops().woq_dequantize(q, scales, neg_offsets, self.group_size, self.bits, dtype)

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        return self._columns_back(layer, self._dequantized(layer, torch.float32))

    def dequantize_rows(self, layer: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        return self._columns_back(layer, self._dequantized(layer, torch.float32, rows))


def _bf16_cpu_refusal(spec: QuantLinearSpec, bits: int) -> str | None:
    """Why a ``bits``-bit weight-only bfloat16 CPU kernel cannot run ``spec`` (the rules
    ``int4_cpu`` and the pairs kernels share), or None."""
    if spec.device.type != "cpu" or spec.dtype != torch.bfloat16:
        return "it runs bfloat16 activations on the CPU only"
    if spec.activations != WEIGHT_ONLY or spec.bits != bits:
        return f"it runs {bits}-bit weight-only formats only"
    if spec.out_features % 16:
        return "it needs a multiple of 16 outputs"
    return None


def pairs_available() -> str | None:
    """``None`` when the pairs kernels (``int4_pairs``, ``int8_pairs``) run here: woq_cpu's library
    built for a CPU with AVX512-BF16, and ``cpu_ops.bf16_gemm`` (their prefill GEMM) on."""
    from vframe.layers import cpu_ops

    if (reason := woq_cpu_available()) is not None:
        return reason
    if not _woq_ops().pairs_available():
        return "it needs a CPU with AVX512-BF16"
    if not cpu_ops.bf16_gemm_available():
        return "it needs cpu_ops.bf16_gemm (off: VFRAME_BF16_GEMM=0, or the fused CPU operators unavailable)"
    return None


class _OnPairs:
    """What the pairs kernels share: they run where ``pairs_available()`` says so, and their
    operators take any row count: up to 64 tokens in place (6 bit: 32; 8 bit and FP4: 12; measured
    crossovers, ``csrc/woq_gemm.cpp``'s ``pairs_in_place_rows``), more through each thread's two
    blocks at a time dequantized into a buffer that stays in its L2 and multiplied as ``bf16_gemm``
    multiplies (its bits: ``bf16_gemm(x, dequantized pairs)``), so that the decode plan takes their
    layers at any batch size it meets. From ``PREFILL_ROWS`` rows (long prefills) ``bf16_gemm`` on
    the weight dequantized whole, a chunk at a time, is 1-3% faster (each of the operator's 256-row
    blocks dequantizes its panels again): the same bits either way."""

    PREFILL_ROWS = 1024
    MAX_ROWS = dict.fromkeys((torch.float32, torch.bfloat16, torch.float16), PREFILL_ROWS - 1)

    @classmethod
    def check_available(cls) -> list[str]:
        reason = pairs_available()
        return [reason] if reason else []

    def _dequantized_product(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` by ``bf16_gemm`` on the weight's blocks of 16 outputs as bfloat16 pairs
        (``_dequantized_pairs``), at most ``CHUNK_BYTES`` of them at a time (an LM head's in blocks
        that stay in cache)."""
        from vframe.layers import cpu_ops

        x = x.contiguous()
        blocks = self.spec.out_features // 16
        step = max(1, self.CHUNK_BYTES // (self.spec.in_features * 2 * 16))
        if step >= blocks:
            return cpu_ops.bf16_gemm(x, self._dequantized_pairs(layer, slice(None)))
        out = x.new_empty(x.shape[0], self.spec.out_features)
        for start in range(0, blocks, step):
            pairs = self._dequantized_pairs(layer, slice(start, start + step))
            out[:, start * 16 : start * 16 + pairs.shape[0] * 16] = cpu_ops.bf16_gemm(x, pairs)
        return out

    def _dequantized_pairs(self, layer: nn.Module, blocks: slice) -> torch.Tensor:
        """Blocks ``blocks`` of the weight as ``bf16_gemm``'s pairs (the kernel's C++ dequantize)."""
        raise NotImplementedError


class _PairsKernel(_OnPairs, _PermutedGemm):
    """Weight-only integer layers in bfloat16 on a CPU with AVX512-BF16 (``csrc/woq_gemm.cpp``'s
    pairs): per block of 16 outputs, 64 bytes a step read as 32 16-bit words, word ``2n + j``
    of output ``n`` (``BITS`` 4: 8 inputs a step, nibble ``t`` holding input ``8p + 2t + j``;
    ``BITS`` 8: 4 inputs a step, the low byte input ``4p + j``, the high one ``4p + 2 + j``),
    scales and zeros per group and output, float16 where exact, else float32. Bits masked out
    of each word and or-ed with ``0x4300`` are bfloat16 values as they are (a nibble ``c``:
    ``128 + c``), four ``vdpbf16ps`` operands a step (no table, no widening), each group's sum
    corrected by its inputs' sum. In place (``_OnPairs``): tiles of 4 rows x 32 outputs (one or
    two rows x 64), every weight byte read once a tile, the panel a thread takes next asked for
    while it works on one; more tokens: bfloat16 pairs (each value the weight's, rounded once)
    multiplied as ``cpu_ops.bf16_gemm`` multiplies. Rows of the weight are read on their own
    (``dequantize_rows``): a tied embedding keeps one copy of its table."""

    BITS: ClassVar[int]
    STEP: ClassVar[int]
    priority = 35  # above int4_cpu (30) and woq_cpu (20): where it runs, it streams fastest

    @classmethod
    def can_implement(cls, spec: QuantLinearSpec) -> str | None:
        if (reason := _bf16_cpu_refusal(spec, cls.BITS)) is not None:
            return reason
        if spec.in_features % spec.group_size or spec.group_size % cls.STEP:
            return f"it needs groups of a multiple of {cls.STEP} inputs that divide the {spec.in_features} inputs"
        return cls.permutable(spec) or pairs_available()

    def prepare(self, layer: nn.Module, weight: IntWeight) -> None:
        weight = self._in_group_order(layer, weight)
        self.group_size = weight.group_size
        q = weight.q.to(torch.uint8)
        self.buffer(layer, "q", {4: _nibble_words, 6: _six_bit_words, 8: _byte_words}[self.BITS](q))

        # w = scale q + zero: the offset at code 0 (a GGUF Q4_1's m, exactly), or none (symmetric)
        scales = weight.scales.float()
        zeros = None if weight.offsets is None else weight.offsets.float() - (1 << (self.BITS - 1)) * scales
        # float16 where it holds every scale and zero exactly (the checkpoints' own float16 / bfloat16
        # scales, GGUF's d and m): fewer bytes to read a step. GPTQ / AWQ zeros, -scale z, take more
        # bits than float16 has: their integer zero points z are kept instead (w = scale (q - z)).
        self.zero_points = False
        if zeros is not None and _exact_in_half(scales) and not _exact_in_half(zeros):
            points = _zero_points(scales, zeros, self.BITS)
            if points is not None:
                zeros, self.zero_points = points, True
        dtype = torch.float16 if all(_exact_in_half(t) for t in (scales, zeros) if t is not None) else torch.float32
        self.buffer(layer, "scales", _per_block(scales.to(dtype)))
        self.buffer(layer, "zeros", torch.empty(0, dtype=dtype) if zeros is None else _per_block(zeros.to(dtype)))

    def _in_place_call(self, layer: nn.Module) -> tuple[Callable[..., torch.Tensor], tuple]:
        return _woq_ops().pairs_gemm.default, (*self._pairs_args(layer), self.BITS, self.zero_points)

    def _pairs_args(self, layer: nn.Module) -> tuple:
        return self.get(layer, "q"), self.get(layer, "scales"), self.get(layer, "zeros"), self.group_size

    def _dequantized_pairs(self, layer: nn.Module, blocks: slice) -> torch.Tensor:
        q, scales, zeros, group = self._pairs_args(layer)
        return _woq_ops().pairs_dequantize(
            q[blocks], scales[blocks], zeros[blocks] if zeros.numel() else zeros, group, self.BITS, self.zero_points)

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        return self._int_weight(layer, None)

    def dequantize_rows(self, layer: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        return self._int_weight(layer, rows)

    def _int_weight(self, layer: nn.Module, rows: torch.Tensor | None) -> torch.Tensor:
        """Output rows ``rows`` (all: None) of the weight, [R, in] float32, the inputs in the
        checkpoint's order: ``scale q + zero`` (symmetric: ``scale (q - mid)``) of the codes read
        back from the layout (the C++ ``pairs_dequantize_rows``), what ``pairs_dequantize``
        computes before its rounding to bfloat16."""
        q, scales, zeros, group = self._pairs_args(layer)
        if rows is None:
            rows = torch.arange(q.shape[0] * 16, device=q.device)
        w = _woq_ops().pairs_dequantize_rows(q, scales, zeros, group, self.BITS, self.zero_points, rows.to(torch.int64))
        return self._columns_back(layer, w)


def _nibble_words(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes uint8 [N, K] (N a multiple of 16, K of 8) in the pairs layout [N / 16, K / 8, 64]:
    per block of 16 outputs and step of 8 inputs, input 8p + 2t + j of output n in nibble t of the
    16-bit word 2n + j."""
    out_features, in_features = codes.shape
    blocks, steps = out_features // 16, in_features // 8
    q = codes.reshape(blocks, 16, steps, 4, 2)  # (b, n, p, t, j)
    low, high = q[:, :, :, 0] | (q[:, :, :, 1] << 4), q[:, :, :, 2] | (q[:, :, :, 3] << 4)  # [b, n, p, j]
    words = torch.stack([low, high], dim=-1)  # (b, n, p, j, byte)
    return words.permute(0, 2, 1, 3, 4).reshape(blocks, steps, 64).contiguous()


def _six_bit_words(codes: torch.Tensor) -> torch.Tensor:
    """6-bit codes uint8 [N, K] (N a multiple of 16, K of 8) in the pairs layout [N / 16, K / 8, 96]:
    per block, ``_nibble_words``' 64 bytes a step of the codes' low 4 bits, then 32 bytes a step, byte
    2n + j holding the high 2 bits of input 8p + 2t + j of output n at bits 2t .. 2t + 1."""
    out_features, in_features = codes.shape
    blocks, steps = out_features // 16, in_features // 8
    high = (codes >> 4).reshape(blocks, 16, steps, 4, 2)  # (b, n, p, t, j)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=codes.device).view(1, 1, 1, 4, 1)
    packed = (high << shifts).sum(dim=3, dtype=torch.uint8)  # [b, n, p, j]: the four planes' bits apart
    low = _nibble_words(codes & 0x0F).reshape(blocks, steps * 64)
    return torch.cat([low, packed.permute(0, 2, 1, 3).reshape(blocks, steps * 32)], dim=1).view(blocks, steps, 96)


def _per_block(t: torch.Tensor) -> torch.Tensor:
    """Per-row values ``[N, G]`` (a scale per output and group) as the pairs operators read them:
    ``[N / 16, G, 16]``, each block's 16 outputs side by side."""
    return t.reshape(t.shape[0] // 16, 16, t.shape[1]).permute(0, 2, 1).contiguous()


def _byte_words(codes: torch.Tensor) -> torch.Tensor:
    """8-bit codes uint8 [N, K] (N a multiple of 16, K of 4) in the pairs layout [N / 16, K / 4, 64]:
    per block of 16 outputs and step of 4 inputs, input 4p + 2 byte + j of output n in byte ``byte``
    of the 16-bit word 2n + j."""
    out_features, in_features = codes.shape
    blocks, steps = out_features // 16, in_features // 4
    q = codes.reshape(blocks, 16, steps, 2, 2).transpose(3, 4)  # (b, n, p, j, byte)
    return q.permute(0, 2, 1, 3, 4).reshape(blocks, steps, 64).contiguous()


def _byte_codes(q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Output rows ``rows`` of ``_byte_words``' layout back as codes, uint8 [R, K]."""
    blocks, steps, _ = q.shape
    q = q.reshape(blocks, steps, 16, 2, 2)[rows // 16, :, rows % 16]  # [R, steps, j, byte]
    return q.transpose(2, 3).reshape(len(rows), -1)  # input 4p + 2 byte + j


def _nibble_codes(q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Output rows ``rows`` of ``_nibble_words``' layout back as codes, uint8 [R, K]."""
    blocks, steps, _ = q.shape
    q = q.reshape(blocks, steps, 16, 2, 2)[rows // 16, :, rows % 16]  # [R, steps, j, byte]
    q = torch.stack([q & 0x0F, q >> 4], dim=-1).permute(0, 1, 3, 4, 2)  # (r, p, byte, half, j): input 8p + 2t + j
    return q.reshape(len(rows), -1)


def _zero_points(scales: torch.Tensor, zeros: torch.Tensor, bits: int) -> torch.Tensor | None:
    """The integer zero points ``z`` with ``zeros == -scales * z`` exactly in float32 (GPTQ / AWQ:
    ``w = s (q - z)``), ``z`` in ``[0, 2**bits]``, or None where the zeros are not of that form."""
    points = torch.where(scales != 0, -zeros / torch.where(scales != 0, scales, 1), 0).round()
    if not (points.min() >= 0 and points.max() <= (1 << bits)):
        return None
    return points if torch.equal(-scales * points, zeros) else None


def _exact_in_half(t: torch.Tensor) -> bool:
    """Whether float16 holds every value of float32 ``t`` exactly (finite, in range)."""
    return bool(torch.isfinite(t).all()) and torch.equal(t.half().float(), t)


class Int4PairsKernel(_PairsKernel):
    """``_PairsKernel`` for 4-bit weights: the default for 4-bit bfloat16 layers on CPUs with
    AVX512-BF16 (``int4_cpu``, torch's kernel, where it cannot run)."""

    BITS = 4
    STEP = 8  # inputs a 64-byte step of a block holds


class Int6PairsKernel(_PairsKernel):
    """``_PairsKernel`` for 6-bit weights (GGUF's Q6_K and, held in 6 bits, its 5-bit types): the
    4-bit layout of each code's low 4 bits, then each step's high 2 bits (32 bytes, a byte per
    word lane), or-ed in at bits 4-5 of each plane's word: the bfloat16 ``128 + q``, as at 4 bit.
    6 bits a weight where ``int8_pairs`` holds 8."""

    BITS = 6
    STEP = 8
    int_bits = (6,)


class Int8PairsKernel(_PairsKernel):
    """``_PairsKernel`` for 8-bit weights: ``q = 128 h + l``, a byte's bits 0-6 and its bit 7 (the
    bfloat16's lowest exponent bit) or-ed with ``0x4300`` are the bfloat16 ``128 + l`` and
    ``128 + 128 h``, both multiplied by the byte's inputs (exact). The default
    for 8-bit weight-only bfloat16 layers on CPUs with AVX512-BF16 (W8A16, GGUF Q8_0 and its
    8-bit types, the Q8_0 tied embedding / LM head)."""

    BITS = 8
    STEP = 4


class _LookupPairs(_OnPairs, _DequantizedGemm, QuantLinearKernel):
    """What the pairs kernels whose codes are looked up in a table (``fp4_pairs``, ``lut4_pairs``,
    ``fp8_pairs``) share: bfloat16 on the CPU, blocks of 16 outputs, the weight read back row by row
    (``dequantize_rows``, which each defines); 4-bit codes in steps of 8 inputs (``fp8_pairs``'
    bytes: 4, its own ``can_implement``)."""

    @classmethod
    def can_implement(cls, spec: QuantLinearSpec) -> str | None:
        if spec.device.type != "cpu" or spec.dtype != torch.bfloat16:
            return "it runs bfloat16 activations on the CPU only"
        if spec.out_features % 16 or spec.in_features % 8:
            return "it needs a multiple of 16 outputs and of 8 inputs"
        return pairs_available()

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        return self.dequantize_rows(layer, torch.arange(self.spec.out_features, device=self.get(layer, "q").device))


class Fp4PairsKernel(_LookupPairs):
    """FP4 weights (NVFP4, MXFP4) in bfloat16 on a CPU with AVX512-BF16 (``csrc/woq_gemm.cpp``'s
    ``fp4_pairs_gemm``): the e2m1 codes in ``int4_pairs``' layout, each nibble plane looked up as
    bfloat16 (``vpermw``, exact) for ``vdpbf16ps``, each group's sum times ``scale(byte) /
    global``; the checkpoint's scale bytes kept as they are (per block of 16 outputs), the global
    scales float32 per row: NVFP4 4.5 bits a weight, MXFP4 4.25, as the checkpoint. Up to 12
    tokens in place, more dequantized for ``bf16_gemm``'s multiplication (``_OnPairs``). A NaN
    scale byte is refused, as ``fp4_cpu`` refuses it."""

    priority = 35  # above fp4_cpu (20), which reads the codes eight at a time in float32
    weight_types = (NVFP4, MXFP4)

    def prepare(self, layer: nn.Module, weight: Fp4Weight) -> None:
        Fp4CpuKernel.refuse_nan_scales(weight, self.spec.layer)
        self.group_size, self.scale_format = weight.group_size, Fp4CpuKernel.SCALE_FORMATS[weight.format]
        self.format = weight.format
        self.buffer(layer, "q", _nibble_words(weight.codes()))
        self.buffer(layer, "scales", _per_block(weight.scales))
        self.buffer(layer, "global_scale", weight.global_scale.float().reshape(-1, 16).contiguous())

    def _args(self, layer: nn.Module) -> tuple:
        return (self.get(layer, "q"), self.get(layer, "scales"), self.get(layer, "global_scale"), self.group_size,
                self.scale_format)

    def _in_place_call(self, layer: nn.Module) -> tuple[Callable[..., torch.Tensor], tuple]:
        return _woq_ops().fp4_pairs_gemm.default, self._args(layer)

    def _dequantized_pairs(self, layer: nn.Module, blocks: slice) -> torch.Tensor:
        q, scales, global_scale, group, scale_format = self._args(layer)
        return _woq_ops().fp4_pairs_dequantize(q[blocks], scales[blocks], global_scale[blocks], group, scale_format)

    def dequantize_rows(self, layer: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """``Fp4Weight.dequantize`` of the rows read back from the layout."""
        codes = _nibble_codes(self.get(layer, "q"), rows)  # [R, K]
        block, n = rows // 16, rows % 16
        weight = Fp4Weight(codes[:, 0::2] | (codes[:, 1::2] << 4), self.get(layer, "scales")[block, :, n],
                           self.get(layer, "global_scale")[block, n], self.format)
        return weight.dequantize()


class WoqCpuA8Kernel(WoqCpuKernel):
    """``woq_cpu``'s weights (the same buffers) for ``INT8_PER_BLOCK`` specs: the C++
    operator ``woq_gemm_a8`` quantizes each block of 32 inputs to int8 and sums its
    products with the weight's integers exactly (AVX2: ``vpmaddubsw`` / ``vpmaddwd``,
    eight groups of 32 reduced together), then scales them in float32, as llama.cpp's
    dot products do. The float path widens every weight to float32 instead; AVX2 EPYC,
    one thread, [1, 576] x [576 -> 1536] 4 bit, groups of 32: 0.125 -> 0.058 ms, 8 bit
    0.187 -> 0.064 ms. More rows than ``MAX_ROWS``: the blocks quantized (the C++
    operator ``quantize_blocks``, bit for bit ``quantize_per_block``), then the
    dequantized weight's GEMM, as ``woq_cpu``."""

    @classmethod
    def can_implement(cls, spec: QuantLinearSpec) -> str | None:
        if spec.activations != INT8_PER_BLOCK:
            return "it runs int8 activations per block of 32 only"
        if spec.group_size % ACTIVATION_BLOCK:
            return f"its groups must be multiples of {ACTIVATION_BLOCK} inputs"
        if spec.act_order:
            return "activation blocks follow the inputs' order; act order permutes them"
        weight_only = dataclasses.replace(spec, activations=WEIGHT_ONLY)
        return super().can_implement(weight_only)

    def _in_place_call(self, layer: nn.Module) -> tuple[Callable[..., torch.Tensor], tuple]:
        return _woq_ops().woq_gemm_a8.default, self._woq_args(layer)

    def _gemm_inputs(self, x: torch.Tensor) -> torch.Tensor:
        return _woq_ops().quantize_blocks(x).to(x.dtype)  # as quantize_per_block spells them, in one C++ pass


def _cpu_weight_only_refusal(spec: QuantLinearSpec, form: str) -> str | None:
    """Why a C++ kernel for weight-only ``form`` weights cannot run ``spec``, or None."""
    if spec.device.type != "cpu":
        return "it runs on the CPU only"
    if spec.activations != WEIGHT_ONLY:
        return f"it runs weight-only {form} only"
    if spec.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return "it runs float32, bfloat16 and float16 activations only"
    return woq_cpu_available()


class Fp8CpuKernel(_DequantizedGemm, QuantLinearKernel):
    """FP8 (e4m3) weights on the CPU, vframe's C++ operators (``csrc/woq_gemm.cpp``): up
    to ``MAX_ROWS`` tokens multiply the e4m3 bytes in place (``fp8_gemm``: shifted into
    float16 bits, converted eight at a time with F16C), more tokens dequantize the weight
    (``fp8_dequantize``, a table per byte) for one GEMM. Before it, FP8 layers
    dequantized the whole weight on every call: AVX2 EPYC, 2 threads, [1, 576] x
    [576 -> 1536] per channel 3,470 -> 90 us. Weights holding e4m3's NaN byte are refused."""

    priority = 20
    weight_types = (FP8_E4M3,)

    @classmethod
    def can_implement(cls, spec: QuantLinearSpec) -> str | None:
        return _cpu_weight_only_refusal(spec, "FP8")

    @staticmethod
    def refuse_nan(q: torch.Tensor, layer: str) -> None:
        """A ``ModelLoadError`` where the e4m3 bytes ``q`` hold NaN (0x7F / 0xFF)."""
        if bool(((q & 0x7F) == 0x7F).any()):
            raise ModelLoadError(f"{layer or 'an FP8 layer'}: the FP8 weight holds NaN (e4m3 bytes 0x7F / 0xFF)")

    def prepare(self, layer: nn.Module, weight: Fp8Weight) -> None:
        q = weight.q.view(torch.uint8)
        self.refuse_nan(q, self.spec.layer)
        self.group_size = weight.group_size
        self.buffer(layer, "q", q.contiguous())  # the checkpoint's bytes, shared where contiguous
        self.buffer(layer, "scales", weight.scales.float().contiguous())

    def _in_place_call(self, layer: nn.Module) -> tuple[Callable[..., torch.Tensor], tuple]:
        return _woq_ops().fp8_gemm.default, (self.get(layer, "q"), self.get(layer, "scales"), self.group_size)

    def _dequantized(
        self, layer: nn.Module, dtype: torch.dtype, rows: torch.Tensor | slice | None = None
    ) -> torch.Tensor:
        q, scales = self.get(layer, "q"), self.get(layer, "scales")
        if rows is not None:
            q, scales = q[rows], scales[rows]
        return _woq_ops().fp8_dequantize(q, scales, self.group_size, dtype)


class Fp4CpuKernel(_DequantizedGemm, QuantLinearKernel):
    """FP4 weights (NVFP4, MXFP4) on the CPU, vframe's C++ operators (``csrc/woq_gemm.cpp``):
    up to ``MAX_ROWS`` tokens multiply the packed e2m1 codes in place (``fp4_gemm``: eight
    codes a vector, their magnitudes looked up with ``vpermps``), more tokens dequantize
    the weight (``fp4_dequantize``) for one GEMM. The layer's buffers are the checkpoint's
    packed codes and scale bytes (NVFP4 4.5 bits a weight, MXFP4 4.25) and a float32
    global scale per row. A NaN scale byte (e4m3 0x7F / 0xFF, e8m0 0xFF) is refused."""

    priority = 20
    weight_types = (NVFP4, MXFP4)
    SCALE_FORMATS = {NVFP4: 0, MXFP4: 1}  # the operators' scale_format: e4m3, e8m0

    @classmethod
    def can_implement(cls, spec: QuantLinearSpec) -> str | None:
        return _cpu_weight_only_refusal(spec, "FP4")

    @staticmethod
    def refuse_nan_scales(weight: Fp4Weight, layer: str) -> None:
        """A ``ModelLoadError`` where a scale byte is NaN (e4m3 0x7F / 0xFF, e8m0 0xFF)."""
        nan = weight.scales == 0xFF if weight.format == MXFP4 else (weight.scales & 0x7F) == 0x7F
        if bool(nan.any()):
            raise ModelLoadError(f"{layer or 'an FP4 layer'}: a scale is NaN ({weight.format} byte)")

    def prepare(self, layer: nn.Module, weight: Fp4Weight) -> None:
        self.refuse_nan_scales(weight, self.spec.layer)
        self.group_size, self.scale_format = weight.group_size, self.SCALE_FORMATS[weight.format]
        self.buffer(layer, "q", weight.q.contiguous())  # the checkpoint's bytes, shared where contiguous
        self.buffer(layer, "scales", weight.scales.contiguous())
        self.buffer(layer, "global_scale", weight.global_scale.float().contiguous())

    def _in_place_call(self, layer: nn.Module) -> tuple[Callable[..., torch.Tensor], tuple]:
        args = (self.get(layer, "q"), self.get(layer, "scales"), self.get(layer, "global_scale"),
                self.group_size, self.scale_format)
        return _woq_ops().fp4_gemm.default, args

    def _dequantized(
        self, layer: nn.Module, dtype: torch.dtype, rows: torch.Tensor | slice | None = None
    ) -> torch.Tensor:
        q, scales, global_scale = (self.get(layer, name) for name in ("q", "scales", "global_scale"))
        if rows is not None:
            q, scales, global_scale = q[rows], scales[rows], global_scale[rows]
        return _woq_ops().fp4_dequantize(q, scales, global_scale, self.group_size, self.scale_format, dtype)


class Lut4CpuKernel(_DequantizedGemm, QuantLinearKernel):
    """``Lut4Weight``s (bitsandbytes' NF4 / FP4) on the CPU, vframe's C++ operators
    (``csrc/woq_gemm.cpp``): up to ``MAX_ROWS`` tokens multiply the packed codes in place
    (``lut4_gemm``: sixteen codes a vector looked up in the table held in one AVX-512 register, or
    eight in two registers of eight on AVX2),
    more tokens dequantize the weight (``lut4_dequantize``) for one GEMM. The layer's buffers are
    the codes (the checkpoint's bytes, nibbles swapped), the float32 group scales and the table."""

    priority = 20
    weight_types = (LUT4,)

    @classmethod
    def can_implement(cls, spec: QuantLinearSpec) -> str | None:
        if spec.group_size % 16:
            return f"its groups of {spec.group_size} inputs are not a multiple of 16"
        return _cpu_weight_only_refusal(spec, "4-bit table")

    def prepare(self, layer: nn.Module, weight: Lut4Weight) -> None:
        self.group_size = weight.group_size
        self.buffer(layer, "q", weight.q.contiguous())
        self.buffer(layer, "scales", weight.scales.float().contiguous())
        self.buffer(layer, "table", weight.table.float().contiguous())

    def _in_place_call(self, layer: nn.Module) -> tuple[Callable[..., torch.Tensor], tuple]:
        args = (self.get(layer, "q"), self.get(layer, "scales"), self.get(layer, "table"), self.group_size)
        return _woq_ops().lut4_gemm.default, args

    def _dequantized(
        self, layer: nn.Module, dtype: torch.dtype, rows: torch.Tensor | slice | None = None
    ) -> torch.Tensor:
        q, scales = self.get(layer, "q"), self.get(layer, "scales")
        if rows is not None:
            q, scales = q[rows], scales[rows]
        return _woq_ops().lut4_dequantize(q, scales, self.get(layer, "table"), self.group_size, dtype)


class Lut4PairsKernel(_LookupPairs):
    """``Lut4Weight``s (bitsandbytes' NF4 / FP4, GGUF's IQ4_NL / IQ4_XS) in bfloat16 on a CPU with
    AVX512-BF16 (``csrc/woq_gemm.cpp``'s ``lut4_pairs_gemm``): the codes in ``int4_pairs``' layout, each
    nibble plane looked up (``vpermw``) in the table rounded to bfloat16 as ``vdpbf16ps`` operands, each
    group's float32 sum times its scale (held in float16 where that is exact, else float32). NF4's
    values are not bfloat16 ones: each code's value is within 2^-9 of the table's, which is what
    bitsandbytes' own bfloat16 dequantization rounds each weight to (``lut4_cpu`` multiplies by the
    float32 table, at twice the time at one token). Up to 64 tokens in place, more through the weight
    dequantized exactly (float32 table times scale, rounded once to bfloat16) for ``bf16_gemm``'s
    multiplication (``_OnPairs``)."""

    priority = 35  # above lut4_cpu (20), which looks the codes up in float32
    weight_types = (LUT4,)

    @classmethod
    def can_implement(cls, spec: QuantLinearSpec) -> str | None:
        if spec.group_size % 8 or spec.in_features % spec.group_size:
            return f"it needs groups of a multiple of 8 inputs that divide the {spec.in_features} inputs"
        return super().can_implement(spec)

    def prepare(self, layer: nn.Module, weight: Lut4Weight) -> None:
        self.group_size = weight.group_size
        self.buffer(layer, "q", _nibble_words(weight.codes()))
        # float16 where it holds every scale exactly (GGUF's IQ4_NL d: the file's 18 bytes per 32 weights)
        scales = weight.scales.float()
        self.buffer(layer, "scales", _per_block(scales.half() if _exact_in_half(scales) else scales))
        self.buffer(layer, "table", weight.table.float().contiguous())

    def _args(self, layer: nn.Module) -> tuple:
        return self.get(layer, "q"), self.get(layer, "scales"), self.get(layer, "table"), self.group_size

    def _in_place_call(self, layer: nn.Module) -> tuple[Callable[..., torch.Tensor], tuple]:
        return _woq_ops().lut4_pairs_gemm.default, self._args(layer)

    def _dequantized_pairs(self, layer: nn.Module, blocks: slice) -> torch.Tensor:
        q, scales, table, group = self._args(layer)
        return _woq_ops().lut4_pairs_dequantize(q[blocks], scales[blocks], table, group)

    def dequantize_rows(self, layer: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """``Lut4Weight.dequantize`` of the rows read back from the layout."""
        codes = _nibble_codes(self.get(layer, "q"), rows)  # [R, K]
        weight = Lut4Weight(codes[:, 0::2] | (codes[:, 1::2] << 4),
                            self.get(layer, "scales")[rows // 16, :, rows % 16].float(), self.get(layer, "table"),
                            self.group_size)
        return weight.dequantize()


class Fp8PairsKernel(_LookupPairs):
    """FP8 (e4m3) weights in bfloat16 on a CPU with AVX512-BF16 (``csrc/woq_gemm.cpp``'s
    ``fp8_pairs_gemm``): the checkpoint's bytes in ``int8_pairs``' layout, each byte plane looked up
    as bfloat16 (``vpermt2w`` over the 128 magnitudes, the sign or-ed in: exact) for ``vdpbf16ps``,
    two operands a 64-byte step, each group's float32 sum times its float32 scale (a scale per row, or
    per block of inputs as block FP8's). Up to 24 tokens in place, more through the weight
    dequantized (e4m3 times scale in float32, rounded once to bfloat16) for ``bf16_gemm``
    (``_OnPairs``). A shorter last group (block FP8's 128 over SmolLM2's 576 inputs) is held as groups
    of the greatest common divisor, each scale repeated (exact); the NaN byte is refused, as
    ``fp8_cpu`` refuses it."""

    priority = 35  # above fp8_cpu (20), which converts eight bytes at a time through float16
    weight_types = (FP8_E4M3,)

    @classmethod
    def can_implement(cls, spec: QuantLinearSpec) -> str | None:
        if spec.device.type != "cpu" or spec.dtype != torch.bfloat16:
            return "it runs bfloat16 activations on the CPU only"
        if spec.activations != WEIGHT_ONLY:
            return "it runs weight-only FP8 only"
        if spec.out_features % 16 or spec.in_features % 4:
            return "it needs a multiple of 16 outputs and of 4 inputs"
        if cls.held_group(spec.group_size, spec.in_features) % 4:
            return f"it needs groups of a multiple of 4 inputs (and a last group of one), not {spec.group_size}"
        return pairs_available()

    @staticmethod
    def held_group(group: int, inputs: int) -> int:
        """The groups the kernel holds: ``group``, or where the last one is shorter, the greatest
        common divisor of the two lengths."""
        return math.gcd(group, inputs % group) if inputs % group else group

    def prepare(self, layer: nn.Module, weight: Fp8Weight) -> None:
        q = weight.q.view(torch.uint8)
        Fp8CpuKernel.refuse_nan(q, self.spec.layer)
        in_features = q.shape[1]
        self.group_size = self.held_group(weight.group_size, in_features)
        scales = weight.scales.float().repeat_interleave(weight.group_size // self.group_size, dim=1)
        self.buffer(layer, "q", _byte_words(q))
        self.buffer(layer, "scales", _per_block(scales[:, : in_features // self.group_size]))

    def _in_place_call(self, layer: nn.Module) -> tuple[Callable[..., torch.Tensor], tuple]:
        return _woq_ops().fp8_pairs_gemm.default, (self.get(layer, "q"), self.get(layer, "scales"), self.group_size)

    def _dequantized_pairs(self, layer: nn.Module, blocks: slice) -> torch.Tensor:
        q, scales = self.get(layer, "q"), self.get(layer, "scales")
        return _woq_ops().fp8_pairs_dequantize(q[blocks], scales[blocks], self.group_size)

    def dequantize_rows(self, layer: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """``Fp8Weight.dequantize`` of the rows read back from the layout."""
        codes = _byte_codes(self.get(layer, "q"), rows)
        weight = Fp8Weight(codes, self.get(layer, "scales")[rows // 16, :, rows % 16], self.group_size)
        return weight.dequantize()


class TorchInt4CpuKernel(_Permuted):
    """torch's ``_weight_int4pack_mm_for_cpu`` (bfloat16 activations on the CPU;
    its scales and offsets are rounded to bfloat16). Groups of 32 to 256 inputs."""

    priority = 30

    @classmethod
    def check_available(cls) -> list[str]:
        return [] if hasattr(torch, "_weight_int4pack_mm_for_cpu") else ["this torch has no _weight_int4pack_mm_for_cpu"]

    @classmethod
    def can_implement(cls, spec: QuantLinearSpec) -> str | None:
        if (reason := _bf16_cpu_refusal(spec, 4)) is not None:
            return reason
        if not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
            return "this torch has no _weight_int4pack_mm_for_cpu"
        if int4_cpu.group_for(spec.in_features, spec.group_size) is None:
            return f"its groups (32 to 256 inputs) do not fit groups of {spec.group_size} over {spec.in_features} inputs"
        return cls.permutable(spec)

    def prepare(self, layer: nn.Module, weight: IntWeight) -> None:
        weight = self._in_group_order(layer, weight)
        self.kernel_group = int4_cpu.group_for(self.spec.in_features, weight.group_size)
        packed, scales_and_zeros = int4_cpu.pack(weight, self.kernel_group)
        self.buffer(layer, "weight", packed)
        self.buffer(layer, "scales_and_zeros", scales_and_zeros)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = self._inputs(layer, x)
        return int4_cpu.matmul(x, self.get(layer, "weight"), self.get(layer, "scales_and_zeros"), self.kernel_group, bias)

    def bind(self, layer: nn.Module, bias: torch.Tensor | None) -> BoundApply | None:
        if self.permuted:
            return None
        weight, scales_and_zeros = self.get(layer, "weight"), self.get(layer, "scales_and_zeros")
        product = functools.partial(int4_cpu.matmul, weight=weight, scales_and_zeros=scales_and_zeros,
                                    kernel_group_size=self.kernel_group, bias=bias)
        # On 2-D activations of fewer than PREFILL_ROWS rows (a decode plan's) matmul is this one
        # operator call, plus the bias; from there it dequantizes and runs a bfloat16 GEMM.
        return with_native(product, NativeCall(torch.ops.aten._weight_int4pack_mm_for_cpu.default,
                                               (weight, self.kernel_group, scales_and_zeros), bias,
                                               int4_cpu.PREFILL_ROWS - 1))

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        w = int4_cpu.unpack(self.get(layer, "weight"), self.get(layer, "scales_and_zeros"), self.kernel_group)
        return self._columns_back(layer, w)


if __name__ == "__main__":  # make install builds the woq_cpu operators once
    import logging

    logging.basicConfig(level=logging.INFO)
    print(woq_library().build())
