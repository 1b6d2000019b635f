"""Quantized linear kernels: registry kind ``quant_kernel`` (plugin API 1.8).

A quantization format (``vframe.quant.base.QuantizationConfig``) reads its
checkpoint's tensors; a *kernel* multiplies by them. The integer weight-only
formats (GPTQ, AWQ, compressed-tensors pack-quantized and W8A8) hand every
layer's weight to a kernel in one form, ``IntWeight``, after loading::

    W[o, i] = scales[o, g(i)] * (q[o, i] - 2**(bits - 1)) + offsets[o, g(i)]

``bits`` 4 or 8, or 6 (plugin API 1.23) for kernels whose ``int_bits`` names it,
with ``g(i) = i // group_size`` or, for act-order checkpoints, ``g_idx[i]``;
``offsets`` is ``None`` for symmetric weights (zero point at the midpoint). A
GPTQ / AWQ zero point ``z`` is the offset ``scales * (2**(bits - 1) - z)``.

FP8 formats (on-the-fly ``fp8``, FP8 checkpoints per tensor, channel or 128 x 128 block,
compressed-tensors FP8) hand over an ``Fp8Weight`` (plugin API 1.10)::

    W[o, i] = e4m3(q[o, i]) * scales[o, i // group_size]

``q`` the e4m3 bytes (uint8 [out, in]), the last group possibly shorter. FP4 weights
(compressed-tensors ``nvfp4-pack-quantized`` and ``mxfp4-pack-quantized``) hand over an
``Fp4Weight`` (plugin API 1.11)::

    W[o, i] = e2m1(q[o, i]) * (scale(scales[o, i // group]) / global_scale[o])

``q`` two FP4 (e2m1) codes a byte, input ``2j`` in the low nibble of byte ``j``; a code's
bit 3 is its sign, bits 0-2 index ``E2M1_VALUES``; ``scales`` one byte per group; the
division comes first, in float32, as compressed-tensors dequantizes. Its ``format``:

* ``NVFP4`` (``"nvfp4"``): groups of 16, ``scales`` e4m3 bytes, ``global_scale`` float32 per
  output row (each fused shard's own);
* ``MXFP4`` (``"mxfp4"``, the OCP microscaling format): groups of 32, ``scales`` e8m0
  bytes (``2 ** (byte - 127)``), ``global_scale`` all ones.

bitsandbytes' 4-bit weights (NF4, FP4) hand over a ``Lut4Weight`` (plugin API 1.21)::

    W[o, i] = table[q[o, i]] * scales[o, i // group_size]

``q`` two codes a byte as FP4's, ``table`` the 16 values a code indexes (float32), ``scales``
float32 per group; the product in float32, as bitsandbytes' ``dequantize_4bit``.

A spec says which form its layer holds (``QuantLinearSpec.weight_type``: ``INT_WEIGHT``,
``FP8_E4M3``, ``NVFP4``, ``MXFP4`` or ``LUT4``); a kernel names the forms it takes in ``weight_types``
(default: integers only) and is never offered another.

Choosing: each layer describes itself as a ``QuantLinearSpec``; the kernel named
by the ``quant_kernel`` setting is used (a layer it cannot run is a
``ConfigError`` naming why), else the registered kernels are tried by
descending ``priority`` and the first whose ``can_implement`` returns ``None``
runs the layer. The built-in ``reference`` kernel runs every spec and is the
last resort. A kernel keeps what it needs as buffers on the layer (names
starting with its registry name), so the format can drop its checkpoint tensors.

Built-in kernels (``vframe.quant.kernels.builtin``; ``triton`` in ``vframe.quant.kernels.gpu``), by priority:

* ``int4_pairs`` and ``int8_pairs`` (35): 4- and 8-bit weight-only layers in bfloat16 on CPUs with
  AVX512-BF16, vframe's C++ operator: each 64-byte step of 16 outputs read as 16-bit words whose
  bit planes or-ed with ``0x4300`` are ``vdpbf16ps`` operands as they are (a nibble ``c``: the
  bfloat16 ``128 + c``; 8 bit, a byte's bits 0-6 and its bit 7: ``128 + l``, ``128 + 128 h``); scales and zeros in float16 where that holds them exactly (GGUF's ``d`` and ``m``, the
  checkpoints' float16 / bfloat16 scales), else float32; each thread's next panel of outputs
  prefetched. Up to 64 tokens (4 bit), 32 (6 bit) or 12 (8 bit, FP4) in place; up to 1,023 each thread dequantizes
  two blocks at a time into its L2 and multiplies them as ``bf16_gemm`` does; from 1,024 (long prefills)
  the weight is dequantized a chunk at a time for ``bf16_gemm``.
* ``int6_pairs`` (35): 6-bit weight-only layers (plugin API 1.23: GGUF's Q6_K, and its 5-bit types
  in 6 bits) the same way: ``int4_pairs``' step of the codes' low 4 bits, then 32 bytes of their
  high 2 bits or-ed in at bits 4-5 of each plane's words; 6 bits a weight.
* ``fp4_pairs`` (35): FP4 weights (NVFP4, MXFP4) the same way in bfloat16: the e2m1 codes in
  ``int4_pairs``' layout, each nibble plane looked up as bfloat16 (``vpermw``), each group's sum
  times its scale byte's value over the row's global scale; the checkpoint's scale bytes kept.
* ``fp8_pairs`` (35): FP8 (e4m3) weights the same way in bfloat16: the bytes in ``int8_pairs``' layout,
  each byte plane looked up as bfloat16 (``vpermt2w`` over the 128 magnitudes, the sign or-ed in),
  two ``vdpbf16ps`` operands a step, each group's sum times its float32 scale (a shorter last
  group held as groups of the greatest common divisor).
* ``lut4_pairs`` (35): ``Lut4Weight``s (bitsandbytes' NF4 / FP4) the same way in bfloat16: each nibble
  plane looked up in the table rounded to bfloat16 (``vpermw``), each group's sum times its float32
  scale; up to 64 tokens in place, more on the weight dequantized exactly (rounded once).
* ``int4_cpu`` (30): torch's ``_weight_int4pack_mm_for_cpu``, 4-bit, bfloat16 on the CPU.
* ``triton`` (25): weight-only integer (4 / 8 bit), FP8 and FP4 layers on NVIDIA GPUs, one
  Triton GEMM that dequantizes the packed weight tile by tile.
* ``woq_cpu`` (20): vframe's C++ weight-only kernel (``csrc/woq_gemm.cpp``), 4 and
  8 bit, any even group that divides the inputs, act order by permuting the inputs;
  activations of up to 16 tokens (32 in float32) are multiplied in place, larger batches
  dequantize the weight into the model's dtype (one C++ pass) for one GEMM.
* ``woq_cpu_a8`` (20): ``woq_cpu``'s weights against activations quantized to int8 per block
  of 32 inputs (``INT8_PER_BLOCK``, what GGUF layers ask for): integer dot products, as
  llama.cpp computes them; groups that are multiples of 32.
* ``int8_dynamic`` (20): W8A8 with per-token int8 activations through ``torch._int_mm``
  (quantization, product and scaling in one C++ call where ``woq_cpu``'s library builds).
* ``fp4_cpu`` (20): vframe's C++ FP4 kernel (NVFP4 and MXFP4): the e2m1 codes read in
  place (a table of eight magnitudes, eight codes a vector) for up to 16 tokens (32 in
  float32), dequantized for one GEMM above.
* ``lut4_cpu`` (20): vframe's C++ kernel for ``Lut4Weight``s: the codes read in place (the table
  in one AVX-512 register, sixteen codes a vector; on AVX2 two registers of eight) for up to 16
  tokens (32 in float32), dequantized
  for one GEMM above.
* ``fp8_cpu`` (20): vframe's C++ FP8 kernel: e4m3 bytes read in place (as float16 bits,
  converted eight at a time with F16C) for up to 16 tokens (32 in float32), dequantized
  for one GEMM above.
* ``reference`` (0): dequantize in float32, cast, ``F.linear``; every spec, every device.

``vframe.testing.check_quant_kernel`` checks a kernel against ``IntWeight.dequantize``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from vframe.errors import ConfigError
from vframe.quant.base import BoundApply

WEIGHT_ONLY = "float"  # activations stay in the model's dtype
INT8_PER_TOKEN = "int8-token"  # activations quantized per token to int8 (dynamic), W8A8
# Activations quantized to int8 per block of 32 consecutive inputs (scale max |x| / 127,
# rounded half to even), the weights' products summed in integers: llama.cpp's numerics
# for its block formats (its Q8_0 / Q8_1 dot products), which GGUF layers ask for
# (plugin API 1.10). vframe.quant.kernels.builtin.quantize_per_block spells it.
INT8_PER_BLOCK = "int8-block"
ACTIVATION_BLOCK = 32  # inputs per INT8_PER_BLOCK block

INT_WEIGHT = "int"  # an IntWeight
FP8_E4M3 = "fp8-e4m3"  # an Fp8Weight (plugin API 1.10)
NVFP4 = "nvfp4"  # an Fp4Weight with e4m3 scales per 16 inputs and a global scale (plugin API 1.11)
MXFP4 = "mxfp4"  # an Fp4Weight with e8m0 scales per 32 inputs (plugin API 1.11)
LUT4 = "lut4"  # a Lut4Weight: 4-bit codes looked up in a 16-value table, a float32 scale per group (plugin API 1.21)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # an FP4 code's magnitude by its bits 0-2
FP4_GROUPS = {NVFP4: 16, MXFP4: 32}  # inputs sharing a scale


@dataclass(frozen=True)
class QuantLinearSpec:
    """What a layer's quantized weight is and where it runs: what kernels choose by."""

    bits: int  # 4 or 8 (FP4: 4)
    group_size: int  # inputs sharing a scale; in_features for one scale per output channel
    symmetric: bool  # no offsets: the zero point is the midpoint 2**(bits - 1)
    act_order: bool  # an input's group is g_idx[i], not i // group_size
    # With act order: every group holds group_size of this rank's inputs, the same for
    # every output row, so sorting the inputs by group makes the groups consecutive.
    equal_groups: bool
    activations: str  # WEIGHT_ONLY, INT8_PER_TOKEN or INT8_PER_BLOCK
    in_features: int  # this rank's
    out_features: int  # this rank's
    dtype: torch.dtype  # the activations' (the model's)
    device: torch.device
    layer: str = ""  # the layer's name, for messages
    # INT_WEIGHT (an IntWeight), FP8_E4M3 (an Fp8Weight), NVFP4 / MXFP4 (an Fp4Weight), LUT4 (a Lut4Weight)
    weight_type: str = INT_WEIGHT

    @classmethod
    def for_weight(
        cls, weight: IntWeight | Fp8Weight | Fp4Weight | Lut4Weight, *, activations: str, dtype: torch.dtype,
        layer: str,
    ) -> QuantLinearSpec:
        """The spec of a layer holding ``weight`` (its sizes, group, symmetry and act order
        read off the weight) whose activations are ``activations`` in ``dtype``."""
        out_features, in_features = weight.q.shape
        if isinstance(weight, Lut4Weight):
            return cls(
                bits=4, group_size=weight.group_size, symmetric=True, act_order=False, equal_groups=True,
                activations=activations, in_features=in_features * 2, out_features=out_features, dtype=dtype,
                device=weight.q.device, layer=layer, weight_type=LUT4,
            )
        if isinstance(weight, Fp4Weight):
            return cls(
                bits=4, group_size=FP4_GROUPS[weight.format], symmetric=True, act_order=False, equal_groups=True,
                activations=activations, in_features=in_features * 2, out_features=out_features, dtype=dtype,
                device=weight.q.device, layer=layer, weight_type=weight.format,
            )
        if isinstance(weight, Fp8Weight):
            return cls(
                bits=8, group_size=weight.group_size, symmetric=True, act_order=False,
                equal_groups=in_features % weight.group_size == 0, activations=activations,
                in_features=in_features, out_features=out_features, dtype=dtype, device=weight.q.device,
                layer=layer, weight_type=FP8_E4M3,
            )
        return cls(
            bits=weight.bits, group_size=weight.group_size, symmetric=weight.offsets is None,
            act_order=weight.g_idx is not None, equal_groups=weight.equal_groups(), activations=activations,
            in_features=in_features, out_features=out_features, dtype=dtype, device=weight.q.device, layer=layer,
        )


@dataclass
class IntWeight:
    """One layer's integer weight in the form every kernel reads (see the module)."""

    bits: int
    q: torch.Tensor  # [out, in] uint8 in [0, 2**bits)
    scales: torch.Tensor  # [out, groups] float32
    offsets: torch.Tensor | None  # [out, groups] float32, None: symmetric
    group_size: int
    # Act order: the group of each input, int64 [in], or [out, in] where fused
    # shards were quantized each in its own order. None: i // group_size.
    g_idx: torch.Tensor | None = None

    def group_of_inputs(self) -> torch.Tensor:  # [out, in] int64
        if self.g_idx is not None:
            return self.g_idx.expand(self.q.shape)
        return (torch.arange(self.q.shape[1], device=self.q.device) // self.group_size).expand(self.q.shape)

    def equal_groups(self) -> bool:
        """Whether every group holds ``group_size`` inputs, the same for every output row."""
        if self.g_idx is None:
            return self.q.shape[1] % self.group_size == 0
        if self.g_idx.dim() == 2:
            return False
        counts = torch.bincount(self.g_idx, minlength=self.scales.shape[1])
        return bool((counts == self.group_size).all())

    def dequantize(self) -> torch.Tensor:  # [out, in] float32, exact for float16 / bfloat16 scales
        g = self.group_of_inputs()
        w = self.scales.float().gather(1, g) * (self.q.float() - (1 << (self.bits - 1)))
        return w if self.offsets is None else w + self.offsets.float().gather(1, g)


@dataclass
class Fp8Weight:
    """One layer's FP8 (e4m3fn) weight in the form FP8 kernels read (see the module)."""

    q: torch.Tensor  # [out, in] uint8: the e4m3 bytes
    scales: torch.Tensor  # [out, ceil(in / group_size)] float32
    group_size: int  # inputs sharing a scale; in_features for one scale per output row

    def dequantize(self) -> torch.Tensor:  # [out, in] float32, exact
        scales = self.scales.float().repeat_interleave(self.group_size, dim=1)[:, : self.q.shape[1]]
        return self.q.view(torch.float8_e4m3fn).float() * scales


@dataclass
class Fp4Weight:
    """One layer's FP4 weight (NVFP4 or MXFP4) in the form FP4 kernels read (see the module)."""

    q: torch.Tensor  # [out, in / 2] uint8: two e2m1 codes a byte, the first input low
    scales: torch.Tensor  # [out, in / group] uint8: each group's scale, e4m3 (NVFP4) or e8m0 (MXFP4) bytes
    global_scale: torch.Tensor  # [out] float32: divides every scale of the row (MXFP4: ones)
    format: str = NVFP4  # NVFP4 or MXFP4

    @property
    def group_size(self) -> int:
        return FP4_GROUPS[self.format]

    def codes(self) -> torch.Tensor:  # [out, in] uint8 in [0, 16)
        return torch.stack([self.q & 0x0F, self.q >> 4], dim=-1).flatten(1)

    def group_scales(self) -> torch.Tensor:  # [out, in / group] float32
        if self.format == MXFP4:
            scales = e8m0_to_float32(self.scales)
        else:
            scales = self.scales.view(torch.float8_e4m3fn).float()
        return scales / self.global_scale.float()[:, None]

    def dequantize(self) -> torch.Tensor:  # [out, in] float32, exact
        codes = self.codes()
        table = torch.tensor(E2M1_VALUES, device=self.q.device)
        values = torch.where(codes >= 8, -table[(codes & 7).long()], table[(codes & 7).long()])
        return values * self.group_scales().repeat_interleave(self.group_size, dim=1)


@dataclass
class Lut4Weight:
    """One layer's 4-bit weight whose codes index a table of 16 values (bitsandbytes' NF4 and
    FP4, GGUF's IQ4_NL and IQ4_XS; plugin API 1.21)::

        W[o, i] = table[code(o, i)] * scales[o, i // group_size]

    the product in float32, as bitsandbytes' ``dequantize_4bit`` computes it."""

    q: torch.Tensor  # [out, in / 2] uint8: two codes a byte, input 2j in the low nibble of byte j
    scales: torch.Tensor  # [out, in / group_size] float32
    table: torch.Tensor  # [16] float32: a code's value
    group_size: int

    def codes(self) -> torch.Tensor:  # [out, in] uint8 in [0, 16)
        return torch.stack([self.q & 0x0F, self.q >> 4], dim=-1).flatten(1)

    def dequantize(self) -> torch.Tensor:  # [out, in] float32, exact
        values = self.table.float()[self.codes().long()]
        return values * self.scales.float().repeat_interleave(self.group_size, dim=1)


def e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """OCP microscaling (MX) e8m0 scale bytes as float32: ``2 ** (byte - 127)``, the byte a
    float's exponent (0: 2 ** -127, a subnormal; 255, NaN in the format, is not read here)."""
    bits = torch.where(scales == 0, 0x00400000, scales.to(torch.int32) << 23)
    return bits.to(torch.int32).view(torch.float32)


class QuantLinearKernel(ABC):
    """Multiplies activations by one layer's ``IntWeight`` (or ``Fp8Weight`` /
    ``Fp4Weight``, for a kernel whose ``weight_types`` names ``FP8_E4M3`` / ``NVFP4``, ``MXFP4``).
    One instance per layer."""

    priority: ClassVar[int] = 10  # higher is tried first when no kernel is named
    weight_types: ClassVar[tuple[str, ...]] = (INT_WEIGHT,)  # the weight forms it takes (plugin API 1.10)
    # the IntWeight bit widths it may be offered (plugin API 1.23: 6 bit, GGUF's 5- and 6-bit types,
    # only to kernels that name it); its can_implement still refuses those of them it does not run
    int_bits: ClassVar[tuple[int, ...]] = (4, 8)

    @classmethod
    @abstractmethod
    def can_implement(cls, spec: QuantLinearSpec) -> str | None:
        """``None`` when this kernel runs ``spec``; else why not (one short clause)."""

    @classmethod
    def check_available(cls) -> list[str]:
        """Why this kernel cannot run any layer on this machine (a missing device, package or
        build), or ``[]``: what ``vframe plugins`` shows (plugin API 1.17). Default ``[]``;
        ``can_implement`` still decides per layer."""
        return []

    def __init__(self, spec: QuantLinearSpec, name: str) -> None:
        self.spec = spec
        self.name = name  # its registry name: the prefix of its buffers on the layer

    @abstractmethod
    def prepare(self, layer: nn.Module, weight: IntWeight | Fp8Weight | Fp4Weight) -> None:
        """Keep what ``apply`` needs as buffers on ``layer``
        (``layer.register_buffer(f"{self.name}_...", t, persistent=False)``)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias``: ``x`` [T, in] in ``spec.dtype`` -> [T, out] in ``spec.dtype``."""

    def bind(self, layer: nn.Module, bias: torch.Tensor | None) -> BoundApply | None:
        """``apply(layer, x, bias)`` as a function of ``x`` alone, with ``layer``'s buffers
        and the operator looked up once (plugin API 1.12; see
        ``vframe.quant.base.LinearMethodBase.bind``): bit for bit ``apply`` for every
        ``x``. The function may carry the single operator call it is
        (``vframe.quant.native_call.with_native``, plugin API 1.13) for a decode plan to
        call from C++. Default ``None``: ``apply`` is called."""
        return None

    @abstractmethod
    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight ``apply`` multiplies by, [out, in] float32 (for checks and references)."""

    def dequantize_rows(self, layer: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """Output rows ``rows`` (int64 [R]) of ``dequantize_weight``, [R, in] float32: what a
        quantized token embedding looks up. Default: the whole weight, then the rows;
        override where a kernel can read rows on their own (``reads_rows``: a GGUF
        embedding then keeps no other copy of its table)."""
        return self.dequantize_weight(layer)[rows]

    def buffer(self, layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
        layer.register_buffer(f"{self.name}_{name}", tensor, persistent=False)

    def get(self, layer: nn.Module, name: str) -> torch.Tensor:
        # the buffer dict first: nn.Module's __getattr__ costs a few microseconds a call,
        # and a decode step reads a few hundred buffers
        key = f"{self.name}_{name}"
        found = layer._buffers.get(key)
        return found if found is not None else getattr(layer, key)


def reads_rows(kernel: QuantLinearKernel) -> bool:
    """Whether ``kernel`` looks rows up on its own (overrides ``dequantize_rows``)
    rather than dequantizing its whole weight for them."""
    return type(kernel).dequantize_rows is not QuantLinearKernel.dequantize_rows


def choose_kernel(spec: QuantLinearSpec, name: str | None = None) -> QuantLinearKernel:
    """The kernel ``name`` for ``spec`` (a ``ConfigError`` saying why it cannot run
    it), or with ``name=None`` the first registered kernel by descending priority
    that can."""
    from vframe.plugins import get_registry

    registry = get_registry("quant_kernel")
    if name is not None:
        cls = registry.load(name)
        if (reason := refusal(cls, spec)) is not None:
            raise ConfigError(f"quant_kernel={name!r} cannot run {_describe(spec)}: {reason}")
        return cls(spec, name)
    candidates = sorted(((registry.load(n), n) for n in registry.names()), key=lambda c: (-c[0].priority, c[1]))
    reasons = []
    for cls, kernel_name in candidates:
        reason = refusal(cls, spec)
        if reason is None:
            return cls(spec, kernel_name)
        reasons.append(f"{kernel_name}: {reason}")
    raise ConfigError(f"no quant_kernel runs {_describe(spec)} ({'; '.join(reasons) or 'none registered'})")


def attach_kernel(
    layer: nn.Module, weight: IntWeight | Fp8Weight | Fp4Weight, activations: str = WEIGHT_ONLY, name: str | None = None
) -> QuantLinearKernel:
    """The kernel that runs ``layer`` from now on: ``choose_kernel`` for ``weight``'s spec
    (``activations``, the layer's dtype and name; ``name``: the ``quant_kernel`` setting),
    prepared on ``layer``. What a quant method calls in ``process_weights_after_loading``."""
    spec = QuantLinearSpec.for_weight(
        weight, activations=activations, dtype=layer.params_dtype, layer=layer.prefix or type(layer).__name__
    )
    kernel = choose_kernel(spec, name)
    kernel.prepare(layer, weight)
    return kernel


def refusal(cls: type[QuantLinearKernel], spec: QuantLinearSpec) -> str | None:
    """Why ``cls`` cannot run ``spec``, or None: a weight form it does not name in
    ``weight_types`` (an ``IntWeight`` bit width not in ``int_bits``) is never offered to its
    ``can_implement``."""
    if spec.weight_type not in cls.weight_types:
        return f"it takes {' and '.join(cls.weight_types)} weights, not {spec.weight_type}"
    if spec.weight_type == INT_WEIGHT and spec.bits not in cls.int_bits:
        return f"it takes {' and '.join(map(str, cls.int_bits))}-bit integer weights, not {spec.bits}-bit"
    return cls.can_implement(spec)


def _describe(spec: QuantLinearSpec) -> str:
    group = "per channel" if spec.group_size == spec.in_features else f"groups of {spec.group_size}"
    kinds = {FP8_E4M3: "FP8 e4m3", NVFP4: "NVFP4", MXFP4: "MXFP4", LUT4: "4-bit table codes"}
    kind = kinds.get(spec.weight_type) or f"{spec.bits}-bit {'symmetric' if spec.symmetric else 'asymmetric'}"
    parts = [
        f"{spec.layer + ': ' if spec.layer else ''}{kind}",
        group, *(["act order" + ("" if spec.equal_groups else " (unequal groups)")] if spec.act_order else []),
        {INT8_PER_TOKEN: "int8 activations", INT8_PER_BLOCK: "int8 activations per block of 32"}.get(
            spec.activations, "weight-only"),
        f"[{spec.out_features}, {spec.in_features}]", f"{str(spec.dtype).removeprefix('torch.')} on {spec.device.type}",
    ]
    return ", ".join(parts)


__all__ = [
    "ACTIVATION_BLOCK",
    "E2M1_VALUES",
    "FP8_E4M3",
    "Fp4Weight",
    "INT_WEIGHT",
    "Fp8Weight",
    "INT8_PER_BLOCK",
    "INT8_PER_TOKEN",
    "LUT4",
    "Lut4Weight",
    "FP4_GROUPS",
    "MXFP4",
    "NVFP4",
    "WEIGHT_ONLY",
    "IntWeight",
    "QuantLinearKernel",
    "QuantLinearSpec",
    "attach_kernel",
    "choose_kernel",
    "reads_rows",
    "refusal",
]
