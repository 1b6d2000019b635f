"""compressed-tensors checkpoints (``quant_method: compressed-tensors``), as
llm-compressor saves them through the ``compressed-tensors`` library.

``quantization_config`` maps modules to schemes::

    config_groups  {name: {targets: ["Linear" | "re:<regex>" | module name],
                           weights: {num_bits, type: int | float, symmetric,
                                     strategy: tensor | channel | group | block, group_size},
                           input_activations: {...} | null, format: ...}}
    ignore         ["lm_head", "re:...", ...]   modules left float
    format         pack-quantized | int-quantized | float-quantized | naive-quantized
                   | mixed-precision (then each group names its own)

Per layer of ``in`` inputs and ``out`` outputs (``pack = 32 // bits``, the first
value in the lowest bits; signed integers are stored plus ``2**(bits - 1)``)::

    pack-quantized   weight_packed      int32 [out, in / pack]
                     weight_scale       [out, groups] (group) or [out, 1] (channel), the model's dtype
                     weight_zero_point  int32 [out / pack, groups]  asymmetric only, packed along the outputs
                     weight_shape       int64 [2]                  (out, in)
                     W[o, i] = scale[o, i // group_size] * (q[o, i] - zero[o, i // group_size])
    int-quantized    weight int8 [out, in], weight_scale [out, 1]; activations int8 per token, dynamic
    float-quantized  weight e4m3 [out, in], weight_scale [1] (tensor) or [out, 1] (channel)
                     or [ceil(out / bn), ceil(in / bk)] (block, ``block_structure: [bn, bk]``;
                     partial blocks at the edges, see ``fp8.BlockFp8Method``),
                     input_scale [1] with static activations
    nvfp4-pack-quantized  weight_packed  uint8 [out, in / 2]  two e2m1 codes a byte, the first input low
                     weight_scale         e4m3 [out, in / 16]  one per group of 16 inputs
                     weight_global_scale  float32 [1]          divides the scales
                     input_global_scale   float32 [1]          NVFP4 (W4A4) only: read, not used
                     W[o, i] = e2m1(q[o, i]) * (scale[o, i // 16] / global_scale)
    mxfp4-pack-quantized  weight_packed  uint8 [out, in / 2]  as NVFP4's
                     weight_scale         uint8 [out, in / 32]  e8m0: 2 ** (byte - 127)
                     W[o, i] = e2m1(q[o, i]) * 2 ** (scale[o, i // 32] - 127)
    mxfp8-quantized  weight e4m3 [out, in], weight_scale uint8 [out, in / 32] (e8m0)
                     W[o, i] = weight[o, i] * 2 ** (scale[o, i // 32] - 127)

Served: W4A16 / W8A16 (pack-quantized, group or channel, symmetric or not), W8A8
int8 (int-quantized, channel or tensor weights, dynamic per-token int8
activations), FP8 weights (float-quantized, tensor, channel or block;
activations stay in the model's dtype), MXFP8 weights (MXFP8A16) and FP4 weights
(NVFP4A16, MXFP4A16; a W4A4 or MXFP8 checkpoint's activations stay in the model's dtype
too, with a warning, as FP8's static ones do), and llm-compressor's attention quantization (a
weightless group targeting the attention modules with static float8 inputs: its key and value
scales are the KV cache's, per tensor or per head; the queries' are read and not used). Everything
else is refused naming the group.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vframe.errors import ConfigError, ModelLoadError
from vframe.layers.linear import LinearBase
from vframe.quant.base import IntKernelMethod, LinearMethodBase, QuantizationConfig, register_weight, setting_of_layer
from vframe.quant.fp8 import (
    FP8_DTYPE, BlockFp8Method, Fp8KernelMethod, _per_shard_loader, block_structure, over_shard_rows,
)
from vframe.quant.kernels import (
    FP4_GROUPS, INT8_PER_TOKEN, MXFP4, NVFP4, WEIGHT_ONLY, Fp4Weight, Fp8Weight, IntWeight, e8m0_to_float32,
)
from vframe.quant.packing import check_divisible, pack_factor, unpack_int32

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class Scheme:
    """One config group's weights, as vframe serves them."""

    group: str = field(compare=False)  # its key in config_groups; groups alike are one scheme
    format: str  # pack-quantized | int-quantized | float-quantized
    type: str  # int | float
    num_bits: int
    symmetric: bool
    strategy: str  # tensor | channel | group | block
    group_size: int | None
    # None (weight-only), "int8-token" (dynamic), "fp8-static", "fp8-dynamic", "nvfp4" / "mxfp4" / "mxfp8" (served
    # weight-only)
    activations: str | None
    block: tuple[int, int] | None = None  # (rows, columns) of a block, strategy "block" only


class CompressedTensorsConfig(QuantizationConfig):
    # 4-bit round to nearest: half a step, at most 1/15 of the group's largest |w|
    # (symmetric scales are max |w| / 7.5); a row-parallel rank of a channel scale
    # may not hold the row's largest |w|, hence twice that; 1e-3 for fp16 / bf16 scales.
    weight_tolerance = 2 / 15 + 1e-3
    # W8A8 rounds each token's activations to int8 (half a step of max |x| / 127).
    # Weight-only schemes stay within float32 rounding (tested on their own).
    reference_tolerance = 2**-6
    # FP4, relative to a group's largest |w|: NVFP4, e2m1's widest step (4 -> 6) rounds by up
    # to one group scale, max |w_g| / 6, which e4m3 rounds by up to 1/16; MXFP4's power-of-two
    # scale (max |w_g| rounded to a power of two, up from 1.75 of one, over 4) puts max |w_g| at
    # 3.5 to 7 scales: cutting to 6 or rounding between 4 and 6 moves a value by up to one scale
    fp4_weight_tolerances = {"nvfp4-pack-quantized": (1 + 1 / 16) / 6 + 1e-3, "mxfp4-pack-quantized": 2 / 7 + 1e-3}

    def __init__(self, schemes: list[tuple[list[str], Scheme]], ignore: list[str]) -> None:
        self.schemes = schemes
        self.ignore = ignore
        fp4 = [self.fp4_weight_tolerances[s.format] for _, s in schemes if s.format in self.fp4_weight_tolerances]
        if fp4:  # this checkpoint's own bound
            self.weight_tolerance = max(fp4)

    def __repr__(self) -> str:
        return f"CompressedTensorsConfig(schemes={[s for _, s in self.schemes]}, ignore={self.ignore})"

    @classmethod
    def get_name(cls) -> str:
        return "compressed-tensors"

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def from_config(cls, hf_quant_config: dict[str, Any] | None) -> CompressedTensorsConfig:
        if hf_quant_config is None:
            raise ConfigError(
                "quantization='compressed-tensors' reads an llm-compressor checkpoint (config.json "
                "quantization_config); this checkpoint is float. Quantize it with llm-compressor first"
            )
        q = hf_quant_config
        if q.get("quant_method", "compressed-tensors") != "compressed-tensors":
            raise ConfigError(
                "quantization='compressed-tensors' reads a compressed-tensors checkpoint; this one is "
                f"quantized as {q.get('quant_method')!r}"
            )
        for key in ("sparsity_config", "transform_config"):
            if q.get(key):
                raise ConfigError(f"quantization_config.{key} is not supported yet; vframe reads weight schemes only")
        _check_kv_cache_scheme(q.get("kv_cache_scheme"))
        status = q.get("quantization_status", "compressed")
        if status != "compressed":
            raise ConfigError(
                f"quantization_config.quantization_status={status!r}: vframe reads compressed checkpoints "
                "(save with save_compressed=True)"
            )
        groups = q.get("config_groups") or {}
        if not groups:
            raise ConfigError("quantization_config.config_groups is empty: nothing says how layers are quantized")
        attention = {name: g for name, g in groups.items() if _attention_group(name, g)}
        if attention:
            logger.info(
                "attention quantization (quantization_config.config_groups %s): the keys' and values' scales go to a "
                "float8 KV cache (kv_cache_dtype='fp8'); the queries' (q_scale) are read and not used: vframe attends "
                "in the model's dtype, as vLLM does outside FlashAttention 3", ", ".join(attention))
        schemes = [(list(g.get("targets") or []), _scheme(name, g, q.get("format")))
                   for name, g in groups.items() if name not in attention]
        if any(s.activations in (NVFP4, MXFP4) for _, s in schemes):
            logger.warning(
                "FP4 W4A4 checkpoint (NVFP4 / MXFP4): vframe multiplies its FP4 weights by activations in the "
                "model's dtype (input_global_scale is read, not used), as vLLM does on GPUs without FP4 tensor cores"
            )
        if any(s.activations == "mxfp8" for _, s in schemes):
            logger.warning("MXFP8 checkpoint: vframe multiplies its MXFP8 weights by activations in the model's dtype")
        config = cls(schemes, list(q.get("ignore") or []))
        config.calibrated_kv_cache = bool(q.get("kv_cache_scheme"))
        return config

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None
        scheme = setting_of_layer(prefix, self._scheme_of, "quantization_config's targets and ignore")
        if scheme is None:
            return None
        if scheme.strategy == "block":
            return BlockFp8Method(scheme.block, "weight_scale", self.quant_kernel)
        if scheme.format in FP4_FORMATS:
            return Fp4Method(scheme, self.quant_kernel)
        if scheme.format == MXFP8_FORMAT:
            return Mxfp8Method(self.quant_kernel)
        if scheme.format == "pack-quantized":
            return PackedMethod(scheme, self.quant_kernel)
        return Int8Method(scheme, self.quant_kernel) if scheme.type == "int" else NaiveMethod(scheme, self.quant_kernel)

    def quantizes_lm_head(self) -> bool:
        # llm-compressor quantizes the head (an nn.Linear) when a target matches it, the class
        # "Linear" included, and ignore does not name it (it unties a tied head first); and
        # compressed-tensors writes every layer of a targeted class it left float into ignore,
        # so a float head is named there. A checkpoint that breaks this is refused at load,
        # naming the float lm_head.weight and what the layer holds instead.
        return self._scheme_of("lm_head") is not None

    def _scheme_of(self, name: str) -> Scheme | None:
        """The scheme of checkpoint module ``name``: ignored first, then the most
        specific target (exact name, then regex, then the class ``Linear``)."""
        if any(_matches(name, target) for target in self.ignore):
            return None
        for kind in ("name", "regex", "class"):
            for targets, scheme in self.schemes:
                if any(_target_kind(t) == kind and _matches(name, t) for t in targets):
                    return scheme
        return None


def _target_kind(target: str) -> str:
    return "regex" if target.startswith("re:") else "class" if target == "Linear" else "name"


def _matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), name) is not None
    return target == "Linear" or target == name


def _check_kv_cache_scheme(scheme: dict[str, Any] | None, where: str = "quantization_config.kv_cache_scheme") -> None:
    """``kv_cache_scheme``: llm-compressor's calibrated KV cache. The ones vLLM serves, static
    float8 scales (``type: float``, 8 bits) per tensor (``strategy: tensor``) or per KV head
    (``attn_head``, plugin API 1.22), arrive as each attention layer's ``k_scale`` / ``v_scale``
    tensors, which the loader hands to the layer's attention impl: with ``kv_cache_dtype="fp8"``
    its cache applies them, with ``"auto"`` they go unused (docs/quantization.md, "FP8 KV
    cache"). Any other scheme is refused naming it."""
    if not scheme:
        return
    wanted = {"type": "float", "num_bits": 8}
    found = {k: scheme.get(k) for k in wanted}
    if (found != wanted or scheme.get("strategy") not in ("tensor", "attn_head")
            or scheme.get("dynamic") not in (None, False) or scheme.get("symmetric") is False):
        raise ConfigError(
            f"{where} {scheme} is not supported: vframe applies static float8 scales "
            "(type 'float', num_bits 8, strategy 'tensor' or 'attn_head', dynamic false, symmetric), as vLLM does"
        )


def _attention_group(name: str, group: dict[str, Any]) -> bool:
    """Whether config group ``name`` is llm-compressor's attention quantization: no weights, static
    float8 scales for the attention's inputs (``targets`` the attention modules, e.g.
    ``LlamaAttention``; ``q_scale`` / ``k_scale`` / ``v_scale`` per tensor or per head), which
    comes with the same ``kv_cache_scheme``. Other weightless groups are ``_scheme``'s to refuse."""
    a = group.get("input_activations")
    if group.get("weights") or not a:
        return False
    _check_kv_cache_scheme(a, f"quantization_config.config_groups.{name}.input_activations")
    return True


def _scheme(name: str, group: dict[str, Any], default_format: str | None) -> Scheme:
    where = f"quantization_config.config_groups.{name}"
    w = group.get("weights")
    if not w:
        raise ConfigError(f"{where}.weights is null: vframe serves weight-quantized schemes only")
    if group.get("output_activations"):
        raise ConfigError(f"{where}.output_activations: output quantization is not supported")
    fmt = group.get("format") or default_format
    if fmt in (None, "mixed-precision"):
        raise ConfigError(f"{where}.format is unset: the group must name its format (e.g. 'pack-quantized')")
    num_bits, wtype, symmetric = w.get("num_bits", 8), w.get("type", "int"), w.get("symmetric", True)
    group_size = w.get("group_size")
    strategy = w.get("strategy") or ("tensor" if group_size is None else "channel" if group_size == -1 else "group")
    label = f"{where} ({fmt}, {wtype}{num_bits} weights, strategy {strategy!r})"
    a = group.get("input_activations")
    if fmt in FP4_FORMATS:
        return _fp4_scheme(name, label, fmt, w, a)
    if fmt == MXFP8_FORMAT:
        return _mxfp8_scheme(name, label, w, a)
    if strategy not in ("tensor", "channel", "group", "block"):
        raise ConfigError(
            f"{label}: strategy {strategy!r} is not supported yet; vframe serves tensor, channel, group, block"
        )
    if w.get("actorder") in ("group", "dynamic", True):
        raise ConfigError(f"{label}: actorder={w['actorder']!r} (weight_g_idx) is not supported; 'weight' is")
    if w.get("dynamic"):
        raise ConfigError(f"{label}: dynamic weight quantization is not supported")
    if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
        raise ConfigError(f"{label}: group_size={group_size!r}, expected a positive integer")

    block = None
    if strategy == "block":
        block = block_structure(w.get("block_structure"), f"{where}.weights.block_structure")

    def scheme(activations: str | None) -> Scheme:
        return Scheme(name, fmt, wtype, num_bits, bool(symmetric), strategy, group_size, activations, block)

    if strategy == "block" and not (fmt in ("float-quantized", "naive-quantized") and wtype == "float"):
        raise ConfigError(f"{label}: block scales are served for FP8 (float-quantized) weights only")
    if fmt == "pack-quantized" and wtype == "int" and num_bits in (4, 8) and strategy in ("group", "channel"):
        if a:
            raise ConfigError(f"{label}: input_activations with packed weights (W4A8) are not supported")
        return scheme(None)
    if fmt in ("int-quantized", "naive-quantized") and wtype == "int" and num_bits == 8 and symmetric:
        if strategy not in ("tensor", "channel"):
            raise ConfigError(f"{label}: int8 weights are served per channel or tensor")
        if not a:
            return scheme(None)
        served = {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True}
        if any(a.get(key) != value for key, value in served.items()):
            raise ConfigError(f"{label}: activations {a!r}; vframe serves dynamic symmetric int8 per token only")
        return scheme("int8-token")
    if fmt in ("float-quantized", "naive-quantized") and wtype == "float" and num_bits == 8 and symmetric:
        if strategy not in ("tensor", "channel", "block"):
            raise ConfigError(f"{label}: FP8 weights are served per tensor, channel or block")
        if not a:
            return scheme(None)
        if a.get("type") != "float" or a.get("num_bits") != 8:
            raise ConfigError(f"{label}: activations {a!r}; vframe serves FP8 activations only with FP8 weights")
        if strategy == "block" and not a.get("dynamic"):
            raise ConfigError(f"{label}: static activation scales with block weights are not supported; dynamic are")
        return scheme("fp8-dynamic" if a.get("dynamic") else "fp8-static")
    raise ConfigError(
        f"{label}, symmetric={symmetric}: not supported; vframe serves pack-quantized int4 / int8, "
        "int-quantized int8 (W8A8), float-quantized FP8, nvfp4- and mxfp4-pack-quantized FP4"
    )


# FP4 formats -> (the Fp4Weight format, the weights' strategy in the config)
FP4_FORMATS = {"nvfp4-pack-quantized": (NVFP4, "tensor_group"), "mxfp4-pack-quantized": (MXFP4, "group")}


def _fp4_scheme(name: str, label: str, fmt: str, w: dict[str, Any], a: dict[str, Any] | None) -> Scheme:
    """NVFP4A16 (float4 weights in groups of 16, e4m3 scales, a global scale per tensor:
    strategy ``tensor_group``) or MXFP4A16 (groups of 32, e8m0 scales: ``group``); their
    W4A4 schemes (NVFP4, MXFP4) served weight-only."""
    form, strategy = FP4_FORMATS[fmt]
    group = FP4_GROUPS[form]
    got = (w.get("type"), w.get("num_bits"), w.get("strategy"), w.get("group_size"), w.get("symmetric", True))
    if got != ("float", 4, strategy, group, True):
        raise ConfigError(
            f"{label}: {fmt} weights are served as float4, strategy {strategy!r}, group_size {group}, symmetric; "
            f"got type={got[0]!r}, num_bits={got[1]!r}, strategy={got[2]!r}, group_size={got[3]!r}, "
            f"symmetric={got[4]!r}"
        )
    if w.get("dynamic"):
        raise ConfigError(f"{label}: dynamic weight quantization is not supported")
    activations = None
    if a:
        if (a.get("type"), a.get("num_bits")) != ("float", 4):
            raise ConfigError(f"{label}: activations {a!r}; with FP4 weights vframe reads float4 ones or none")
        activations = form
    return Scheme(name, fmt, "float", 4, True, strategy, group, activations)


MXFP8_FORMAT = "mxfp8-quantized"
MXFP8_GROUP = 32


def _mxfp8_scheme(name: str, label: str, w: dict[str, Any], a: dict[str, Any] | None) -> Scheme:
    """MXFP8A16 (e4m3 weights, an e8m0 scale per group of 32 inputs); the MXFP8 scheme's
    dynamic float8 activations served weight-only."""
    got = (w.get("type"), w.get("num_bits"), w.get("strategy"), w.get("group_size"), w.get("symmetric", True))
    if got != ("float", 8, "group", MXFP8_GROUP, True) or w.get("dynamic"):
        raise ConfigError(
            f"{label}: {MXFP8_FORMAT} weights are served as static float8, strategy 'group', group_size "
            f"{MXFP8_GROUP}, symmetric; got type={got[0]!r}, num_bits={got[1]!r}, strategy={got[2]!r}, "
            f"group_size={got[3]!r}, symmetric={got[4]!r}"
        )
    if a and (a.get("type"), a.get("num_bits")) != ("float", 8):
        raise ConfigError(f"{label}: activations {a!r}; with MXFP8 weights vframe reads float8 ones or none")
    return Scheme(name, MXFP8_FORMAT, "float", 8, True, "group", MXFP8_GROUP, "mxfp8" if a else None)


class Mxfp8Method(Fp8KernelMethod):
    """MXFP8 weights (compressed-tensors' ``mxfp8-quantized``, ModelOpt's ``MXFP8``): e4m3
    ``weight`` and an e8m0 ``weight_scale`` byte per group of 32 inputs, on an FP8 quant kernel
    as an ``Fp8Weight`` with groups of 32 (``fp8_cpu`` on the CPU reads the e4m3 bytes in place;
    the scales become float32 there, 4 bytes a group, and the checkpoint's bytes are dropped)."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        where = layer.prefix or type(layer).__name__
        check_divisible(input_size_per_partition, MXFP8_GROUP, f"{where}: the input size per partition",
                        f"MXFP8 scales groups of {MXFP8_GROUP} inputs")
        out = sum(output_partition_sizes)
        register_weight(layer, "weight", torch.empty(out, input_size_per_partition, dtype=FP8_DTYPE),
                        {"output_dim": 0, "input_dim": 1})  # [out, in] e4m3
        register_weight(layer, "weight_scale",
                        torch.empty(out, input_size_per_partition // MXFP8_GROUP, dtype=torch.uint8),
                        {"output_dim": 0, "input_dim": 1})  # [out, in / 32] e8m0

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if bool((layer.weight_scale == 0xFF).any()):
            raise ModelLoadError(f"{layer.prefix or 'an MXFP8 layer'}: a scale byte is 0xFF, e8m0's NaN")
        self.attach_kernel(layer)
        if "weight_scale" in layer._parameters:
            del layer.weight_scale  # the kernel holds the scales (float32 from the e8m0 bytes)

    def fp8_weight(self, layer: nn.Module) -> Fp8Weight:
        return Fp8Weight(layer.weight.view(torch.uint8), e8m0_to_float32(layer.weight_scale), MXFP8_GROUP)

    def checkpoint_weight(self, layer: nn.Module) -> torch.Tensor:  # [out, in] float32, exact
        if self.kernel is not None:
            return self.kernel.dequantize_weight(layer)
        return self.fp8_weight(layer).dequantize()


class PackedMethod(IntKernelMethod):
    """pack-quantized int4 / int8 weights, group or channel scales."""

    checkpoint_params = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")

    def __init__(self, scheme: Scheme, kernel_name: str | None = None) -> None:
        super().__init__(kernel_name)
        self.scheme = scheme

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        s = self.scheme
        pack = pack_factor(s.num_bits)
        where = layer.prefix or type(layer).__name__
        why = f"compressed-tensors packs {pack} {s.num_bits}-bit values per int32"
        check_divisible(input_size_per_partition, pack, f"{where}: the input size per partition", why)
        if not s.symmetric:  # the zero points are packed along the outputs
            for size in output_partition_sizes:
                check_divisible(size, pack, f"{where}: an output shard", why)
        split_inputs = input_size_per_partition != input_size
        if s.strategy == "channel":
            num_groups, group_input_dim = 1, None
            self.group_size = input_size_per_partition
        else:
            if split_inputs:
                check_divisible(
                    input_size_per_partition, s.group_size, f"{where}: the input size per partition",
                    f"tensor-parallel ranks split the groups of {s.group_size} inputs",
                )
            num_groups, group_input_dim = -(-input_size_per_partition // s.group_size), 1
            self.group_size = s.group_size
        out = sum(output_partition_sizes)
        register_weight(layer, "weight_packed", torch.empty(out, input_size_per_partition // pack, dtype=torch.int32),
                  {"output_dim": 0, "input_dim": 1})  # [out, in / pack]
        # float32 holds fp16 and bf16 checkpoint scales exactly.
        register_weight(layer, "weight_scale", torch.empty(out, num_groups, dtype=torch.float32),
                  {"output_dim": 0, "input_dim": group_input_dim})  # [out, groups]
        if not s.symmetric:
            register_weight(layer, "weight_zero_point", torch.empty(out // pack, num_groups, dtype=torch.int32),
                      {"output_dim": 0, "input_dim": group_input_dim})  # [out / pack, groups]
        register_weight(layer, "weight_shape", torch.empty(2, dtype=torch.int64),
                  {"output_dim": None, "weight_loader": _weight_shape_loader(layer)})

    def int_weight(self, layer: nn.Module) -> IntWeight:
        bits = self.scheme.num_bits
        q = unpack_int32(layer.weight_packed, bits, dim=1)  # [out, in], offset by 2**(bits - 1) when symmetric
        offsets = None
        if not self.scheme.symmetric:
            zeros = unpack_int32(layer.weight_zero_point, bits, dim=0)  # [out, groups]
            offsets = layer.weight_scale * ((1 << (bits - 1)) - zeros)
        return IntWeight(bits, q.to(torch.uint8), layer.weight_scale, offsets, self.group_size)


class Fp4Method(IntKernelMethod):
    """nvfp4- / mxfp4-pack-quantized weights on an FP4 quant kernel (``fp4_cpu`` on the
    CPU), which reads the checkpoint's packed codes and scale bytes where they lie."""

    # the checkpoint's names of the packed codes, NVFP4's global scale and its input scale
    packed_name, global_scale_name, input_scale_name = "weight_packed", "weight_global_scale", "input_global_scale"
    checkpoint_params = (packed_name, "weight_scale", global_scale_name, input_scale_name)

    def __init__(self, scheme: Scheme, kernel_name: str | None = None) -> None:
        super().__init__(kernel_name)
        self.scheme = scheme
        self.form = FP4_FORMATS[scheme.format][0]  # NVFP4 or MXFP4

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        where, group = layer.prefix or type(layer).__name__, self.scheme.group_size
        check_divisible(input_size_per_partition, group, f"{where}: the input size per partition",
                        f"{self.form.upper()} scales groups of {group} inputs")
        out, shards = sum(output_partition_sizes), len(output_partition_sizes)
        register_weight(layer, self.packed_name, torch.empty(out, input_size_per_partition // 2, dtype=torch.uint8),
                        {"output_dim": 0, "input_dim": 1})  # [out, in / 2]
        scale_dtype = FP8_DTYPE if self.form == NVFP4 else torch.uint8  # e4m3, or e8m0 exponents
        register_weight(layer, "weight_scale", torch.empty(out, input_size_per_partition // group, dtype=scale_dtype),
                        {"output_dim": 0, "input_dim": 1})  # [out, in / group]
        if self.form == NVFP4:  # one per fused shard, repeated over its rows after loading
            register_weight(layer, self.global_scale_name, torch.empty(shards, dtype=torch.float32),
                            {"output_dim": None, "weight_loader": _per_shard_loader(layer)})
            if self.scheme.activations:  # read, not used: activations stay in the model's dtype
                register_weight(layer, self.input_scale_name, torch.empty(shards, dtype=torch.float32),
                                {"output_dim": None, "weight_loader": _per_shard_loader(layer)})

    def int_weight(self, layer: nn.Module) -> Fp4Weight:  # the kernel's form of the weight: here FP4's
        scales = layer.weight_scale.view(torch.uint8)
        packed = getattr(layer, self.packed_name)
        if self.form == MXFP4:
            return Fp4Weight(packed, scales, torch.ones(scales.shape[0], device=scales.device), MXFP4)
        return Fp4Weight(packed, scales, self.global_scale(layer), NVFP4)

    def global_scale(self, layer: nn.Module) -> torch.Tensor:  # [out] float32, dividing each row's scales
        return over_shard_rows(layer, getattr(layer, self.global_scale_name))


class NaiveMethod(Fp8KernelMethod):
    """FP8 weights stored as they are (activations stay in the model's dtype), on an FP8
    quant kernel after loading (``fp8_cpu`` on the CPU)."""

    def __init__(self, scheme: Scheme, kernel_name: str | None = None) -> None:
        super().__init__(kernel_name)
        self.scheme = scheme

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        s = self.scheme
        dtype = torch.int8 if s.type == "int" else FP8_DTYPE
        out = sum(output_partition_sizes)
        register_weight(layer, "weight", torch.empty(out, input_size_per_partition, dtype=dtype),
                  {"output_dim": 0, "input_dim": 1})  # [out, in]
        if s.strategy == "channel":
            register_weight(layer, "weight_scale", torch.empty(out, 1, dtype=torch.float32), {"output_dim": 0})  # [out, 1]
        else:  # one scale per fused shard, repeated over its rows after loading
            register_weight(layer, "weight_scale", torch.empty(len(output_partition_sizes), dtype=torch.float32),
                      {"output_dim": None, "weight_loader": _per_shard_loader(layer)})
        if s.activations == "fp8-static":  # read, not used: activations stay in the model's dtype
            register_weight(layer, "input_scale", torch.empty(len(output_partition_sizes), dtype=torch.float32),
                      {"output_dim": None, "weight_loader": _per_shard_loader(layer)})

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.weight_scale = nn.Parameter(_row_scales(layer, self.scheme), requires_grad=False)  # [out] float32
        if self.scheme.activations == "fp8-static":
            layer.input_scale = None
        self.attach_kernel(layer)

    def checkpoint_weight(self, layer: nn.Module) -> torch.Tensor:  # [out, in] float32, exact
        return layer.weight.float() * layer.weight_scale[:, None]


class Int8Method(IntKernelMethod):
    """int-quantized int8 weights (channel or tensor scales), with dynamic per-token
    int8 activations (W8A8) or weight-only; run on a quant kernel."""

    checkpoint_params = ("weight", "weight_scale")

    def __init__(self, scheme: Scheme, kernel_name: str | None = None) -> None:
        super().__init__(kernel_name)
        self.scheme = scheme
        self.activations = INT8_PER_TOKEN if scheme.activations == "int8-token" else WEIGHT_ONLY

    create_weights = NaiveMethod.create_weights  # the same checkpoint tensors, int8

    def int_weight(self, layer: nn.Module) -> IntWeight:
        q = (layer.weight.to(torch.int16) + 128).to(torch.uint8)  # [out, in], offset by 128
        return IntWeight(8, q, _row_scales(layer, self.scheme)[:, None], None, layer.input_size_per_partition)


def _row_scales(layer: nn.Module, scheme: Scheme) -> torch.Tensor:  # [out] float32
    """One weight scale per output row: per-tensor scales repeated over their shard's rows."""
    scale = layer.weight_scale
    if scheme.strategy == "tensor":
        scale = over_shard_rows(layer, scale)
    return scale.reshape(-1)


def _weight_shape_loader(layer: LinearBase):
    """``weight_shape`` (out, in) of a checkpoint tensor: checked against the layer's inputs, not kept per shard."""

    def load(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if int(loaded_weight[-1]) != layer.input_size:
            raise ModelLoadError(
                f"weight_shape {loaded_weight.tolist()}: {layer.prefix or type(layer).__name__} has "
                f"{layer.input_size} inputs"
            )
        param.data.copy_(loaded_weight.reshape(-1)[-2:])

    return load
