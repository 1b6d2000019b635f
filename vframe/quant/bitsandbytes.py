"""bitsandbytes checkpoints (``quant_method: bitsandbytes``), pre-quantized as transformers
saves a model loaded with ``BitsAndBytesConfig`` (Unsloth's ``*-bnb-4bit`` releases are such).

4 bit (``load_in_4bit``, ``bnb_4bit_quant_type`` ``nf4`` or ``fp4``): per checkpoint module::

    weight                                   uint8 [out * in / 2, 1]  two codes a byte, the first in the high nibble,
                                                                      the [out, in] weight flattened row by row
    weight.absmax                            float32 [blocks]         one scale per ``blocksize`` (64) codes;
                                             uint8 [blocks]           with double quantization (``use_double_quant``):
    weight.nested_absmax                     float32 [blocks / 256]     absmax = nested_quant_map[byte] *
    weight.nested_quant_map                  float32 [256]              nested_absmax[block // nested_blocksize]
                                                                        + nested_offset
    weight.quant_map                         float32 [16]             the code's value (NF4's or FP4's table)
    weight.quant_state.bitsandbytes__nf4     uint8 JSON               shape, blocksize, nested_blocksize / _offset
    W[o, i] = quant_map[code] * absmax[(o * in + i) // blocksize]

(bitsandbytes' own ``dequantize_4bit``, bit for bit: tests/quant_real). The dotted names are
not parameter names: ``checkpoint_tensor_name`` maps them to ``weight_absmax``, ...,
``weight_quant_state``. A fused layer (q / k / v, gate / up) receives each module's set; once
loaded, the layer's weight is a ``Lut4Weight`` (the checkpoint's code bytes with their nibbles
swapped, float32 scales with double quantization undone once, the table) on the quant kernel
chosen for it (``lut4_pairs`` / ``lut4_cpu`` on the CPU, else the ``reference``), its scales
per group of ``gcd(block size, inputs)`` inputs: the blocks themselves where they tile the rows
(a row's inputs a multiple of the block size, as in the usual model sizes: 576, 2048, 4864,
8960, 14336, ...), else the parts of the blocks the rows cut (bitsandbytes blocks the flattened
weight: 96 inputs, groups of 32), each its block's scale, where those are ``MIN_GROUP`` (16)
or more. Where they are smaller, the layer keeps ``qweight`` (uint8 [out, in / 2]), ``scales``
(float32, each module's blocks in turn) and ``table`` and dequantizes them (``table[code] *
scale``, float32, as bitsandbytes) into ``F.linear`` on every call. Under tensor parallelism
each module's codes (one a byte) and group scales go through the layer's own loader, which
keeps this rank's rows or inputs (refused where those cut groups below ``MIN_GROUP``).

8 bit (``load_in_8bit``, LLM.int8's weights)::

    weight         int8 [out, in]
    SCB            float32 [out]    each row's absmax: W[o, i] = weight[o, i] * SCB[o] / 127
    weight_format  uint8 []         0: row-major (the only layout saved)

runs as an ``IntWeight`` on the quant kernels (``int8_pairs`` / ``woq_cpu``; ``weight`` and ``SCB``
split across tensor-parallel ranks as float tensors are), weight-only:
activations stay in the model's dtype (bitsandbytes' LLM.int8 matmul rounds them to int8 by
row, with columns above ``llm_int8_threshold`` kept in float16; vLLM's CPU-less path likewise
computes with these weights).

Modules in ``llm_int8_skip_modules`` stay float (the LM head always does, as transformers
leaves it).

In flight (``quantization="bitsandbytes"`` on a float checkpoint, vLLM's in-flight mode): each
checkpoint module's weight, as it is loaded (this rank's part, in float32 from the checkpoint's
values), is quantized as bitsandbytes' ``quantize_4bit(w, blocksize=64, quant_type="nf4",
compress_statistics=True)`` does, and the absmax's double quantization undone once, as vLLM's
loader does: the layer then holds what a ``bnb-4bit`` checkpoint of the same weights holds. Only
one layer's float weight exists at a time.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vframe.errors import ConfigError, ModelLoadError
from vframe.layers.linear import LinearBase
from vframe.quant.base import (
    BoundApply, IntKernelMethod, LinearMethodBase, QuantizationConfig, bound_apply, fused_shard_index, listed_as_float,
    load_rank_part, register_weight,
)
from vframe.quant.fp8 import _per_shard_loader
from vframe.quant.kernels import WEIGHT_ONLY, IntWeight, Lut4Weight, attach_kernel

NAME = "bitsandbytes"
QUANT_TYPES = ("nf4", "fp4")
# 4-bit checkpoint tensors: the suffix after "<module>.weight." -> the parameter it loads into
_FOUR_BIT_TENSORS = {
    "absmax": "weight_absmax",
    "nested_absmax": "weight_nested_absmax",
    "nested_quant_map": "weight_nested_quant_map",
    "quant_map": "weight_quant_map",
}
_SINGLE_QUANT_TENSORS = {k: v for k, v in _FOUR_BIT_TENSORS.items() if not k.startswith("nested_")}
_QUANT_STATE = "quant_state.bitsandbytes__"  # + the quant type: the JSON state's tensor
# bitsandbytes' NF4 table (bitsandbytes.functional.get_4bit_type("nf4")), float32, ascending
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
# in flight, as vLLM's loader asks bitsandbytes: NF4 blocks of 64, the absmax in 8 bits per 256 blocks
IN_FLIGHT_BLOCK, IN_FLIGHT_NESTED_BLOCK = 64, 256
# The smallest group of inputs a 4-bit layer's scales are held in where rows or tensor-parallel ranks cut
# its blocks (a block's scale repeated for each of its groups); the 4-bit kernels take multiples of 16.
MIN_GROUP = 16


class BitsAndBytesConfig(QuantizationConfig):
    # NF4 spaces its 16 values by the normal distribution's quantiles: the widest gap (between
    # 0.7230 and 1) is 0.277 of a block's absmax, so rounding moves a weight by at most 0.139 of
    # it (FP4's widest gap, 0.6667 to 1, by 0.167); double quantization moves the absmax itself
    # by up to 1/255 of its nested block's spread.
    weight_tolerance = 0.18

    def __init__(self, bits: int, quant_type: str | None, skip_modules: list[str], double_quant: bool = False,
                 in_flight: bool = False) -> None:
        self.bits = bits
        self.quant_type = quant_type  # 4 bit: "nf4" or "fp4"
        self.double_quant = double_quant  # 4 bit: absmax quantized to 8 bits (nested_absmax, nested_quant_map)
        self.skip_modules = skip_modules
        self.in_flight = in_flight  # a float checkpoint, quantized to NF4 while loading

    def __repr__(self) -> str:
        return (f"BitsAndBytesConfig(bits={self.bits}, quant_type={self.quant_type!r}, "
                f"double_quant={self.double_quant}, skip={self.skip_modules}, in_flight={self.in_flight})")

    @classmethod
    def get_name(cls) -> str:
        return NAME

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def from_config(cls, hf_quant_config: dict[str, Any] | None) -> BitsAndBytesConfig:
        if hf_quant_config is None:  # a float checkpoint: quantized while loading, as vLLM's in-flight mode
            return cls(4, "nf4", [], double_quant=True, in_flight=True)
        q = hf_quant_config
        if q.get("quant_method", NAME) != NAME:
            raise ConfigError(f"quantization='bitsandbytes' reads a bitsandbytes checkpoint; this one is quantized "
                              f"as {q.get('quant_method')!r}")
        four, eight = bool(q.get("load_in_4bit")), bool(q.get("load_in_8bit"))
        if four == eight:
            raise ConfigError(
                f"quantization_config: load_in_4bit={q.get('load_in_4bit')!r}, load_in_8bit={q.get('load_in_8bit')!r}; "
                "expected exactly one of them true"
            )
        skip = list(q.get("llm_int8_skip_modules") or [])
        if eight:
            if q.get("llm_int8_has_fp16_weight"):
                raise ConfigError("quantization_config.llm_int8_has_fp16_weight=true: the checkpoint keeps float "
                                  "weights for training; vframe reads int8 ones (false)")
            return cls(8, None, skip)
        quant_type = q.get("bnb_4bit_quant_type", "fp4")
        if quant_type not in QUANT_TYPES:
            raise ConfigError(f"quantization_config.bnb_4bit_quant_type={quant_type!r}: expected one of {QUANT_TYPES}")
        storage = q.get("bnb_4bit_quant_storage", "uint8")
        if storage != "uint8":
            raise ConfigError(f"quantization_config.bnb_4bit_quant_storage={storage!r}: vframe reads codes stored "
                              "as uint8 (the default)")
        return cls(4, quant_type, skip, bool(q.get("bnb_4bit_use_double_quant", False)))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None
        if listed_as_float(prefix, self.skip_modules, "quantization_config.llm_int8_skip_modules"):
            return None
        if self.in_flight:  # each rank quantizes its own part
            return BnB4BitInFlightMethod(self.quant_kernel)
        if self.bits == 4:
            return BnB4BitMethod(self.quant_type, self.double_quant, self.quant_kernel)
        return BnB8BitMethod(self.quant_kernel)

    def checkpoint_tensor_name(self, name: str) -> str:
        """``<module>.weight.absmax`` -> ``<module>.weight_absmax``, ...,
        ``<module>.weight.quant_state.bitsandbytes__nf4`` -> ``<module>.weight_quant_state``."""
        module, found, rest = name.partition(".weight.")
        if not found:
            return name
        if rest in _FOUR_BIT_TENSORS:
            return f"{module}.{_FOUR_BIT_TENSORS[rest]}"
        if rest.startswith(_QUANT_STATE):
            return f"{module}.weight_quant_state"
        return name


class BnB4BitMethod(LinearMethodBase):
    """One layer's NF4 / FP4 weight (see the module)."""

    def __init__(self, quant_type: str, double_quant: bool, kernel_name: str | None = None) -> None:
        self.quant_type = quant_type
        self.kernel_name = kernel_name  # the quant_kernel setting
        self.kernel: Any = None  # a quant kernel's, where the blocks tile the rows
        self.tensors = ("weight", *(_FOUR_BIT_TENSORS if double_quant else _SINGLE_QUANT_TENSORS).values(),
                        "weight_quant_state")
        self.shards: dict[int, dict[str, torch.Tensor]] = {}  # shard index -> its checkpoint tensors, until processed

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        self._note_layer(layer, input_size_per_partition, output_partition_sizes, input_size, output_size)
        # Placeholders: each shard's tensors differ in size (a flattened code count, blocks per
        # nested block), so they are kept as they come (whole modules, whichever the rank) and
        # joined once all are in.
        for name in self.tensors:
            register_weight(layer, name, torch.empty(0, dtype=torch.uint8),
                            {"output_dim": None, "input_dim": None, "weight_loader": self._loader(name)})

    def _note_layer(self, layer: nn.Module, in_features: int, output_partition_sizes: list[int], input_size: int,
                    output_size: int) -> None:
        self.where = layer.prefix or type(layer).__name__
        self.shard_ids = layer.shard_ids
        self.output_partition_sizes = list(output_partition_sizes)
        self.in_features = in_features
        self.input_size = input_size  # the whole layer's inputs (a checkpoint module's)
        # this rank holds part of the layer (tensor parallelism): its rows or its inputs of each module
        self.split = in_features != input_size or sum(output_partition_sizes) != output_size
        self.layer_loader = layer.weight_loader  # places this rank's part of a checkpoint tensor

    def _loader(self, name: str) -> Any:
        def load(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
            index = fused_shard_index(self.shard_ids, shard_id, self.where, "bitsandbytes")
            self.shards.setdefault(index, {})[name] = loaded_weight

        return load

    def _shard_name(self, index: int) -> str:
        return self.where if not self.shard_ids else f"{self.where} ({self.shard_ids[index]})"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        shards = [_unpack_shard(self.shards.get(index, {}), None if self.split else rows, self.input_size,
                                self.quant_type, self._shard_name(index))
                  for index, rows in enumerate(self.output_partition_sizes)]
        if any(not torch.equal(shard[2], shards[0][2]) for shard in shards[1:]):
            raise ModelLoadError(f"{self.where}: its fused modules carry different quant_map tables")
        for name in self.tensors:
            delattr(layer, name)
        self.shards.clear()
        self._hold(layer, shards, whole_modules=True)

    def _hold(self, layer: nn.Module, shards: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
              whole_modules: bool) -> None:
        """Keep the layer's shards (each module's codes, uint8 [rows, inputs / 2] as bitsandbytes
        packs them, float32 scales of the blocks of its flattened weight, table, block size) as a
        ``Lut4Weight`` on a quant kernel where each row's inputs cut into groups of at least
        ``MIN_GROUP`` that each lie in one block (the scale a group's block's), else as they are
        (see the module). ``whole_modules``: the checkpoint's modules, of which a rank split by
        tensor parallelism takes its part here; else this rank's part already (in flight)."""
        row_inputs = self.input_size if whole_modules else self.in_features  # what a module's blocks run over
        place = whole_modules and self.split
        loader = vars(self).pop("layer_loader")  # the layer's bound method: loading is over
        group = math.gcd(row_inputs, self.in_features, *(shard[3] for shard in shards))
        if group >= MIN_GROUP or all(shard[3] == group for shard in shards):
            parts = [(codes, _group_scales(absmax, codes.shape[0], row_inputs, blocksize, group))
                     for codes, absmax, _, blocksize in shards]
            codes, scales = self._rank_part(parts, group, loader) if place else [torch.cat(t) for t in zip(*parts)]
            q = ((codes & 0x0F) << 4) | (codes >> 4)  # the first code of a byte in its low nibble
            self.kernel = attach_kernel(layer, Lut4Weight(q, scales, shards[0][2], group), WEIGHT_ONLY,
                                        self.kernel_name)
            return
        if place:
            raise ConfigError(
                f"{self.where}: bitsandbytes' blocks of {shards[0][3]} codes run over the flattened weight; with "
                f"{row_inputs} inputs a row, of which this rank takes {self.in_features}, they do not split "
                f"across tensor-parallel ranks in groups of {MIN_GROUP} or more; use tensor_parallel_size=1"
            )
        codes, scales, table = torch.cat([s[0] for s in shards]), torch.cat([s[1] for s in shards]), shards[0][2]
        self.blocks = [(shard[0].shape[0], len(shard[1]), shard[3]) for shard in shards]
        layer.register_buffer("qweight", codes)  # [out, in / 2] uint8, the checkpoint's bytes
        layer.register_buffer("scales", scales)  # [blocks] float32, each module's blocks in turn
        layer.register_buffer("table", table)  # [16] float32

    def _rank_part(self, parts: list[tuple[torch.Tensor, torch.Tensor]], group: int, loader: Any) -> list[torch.Tensor]:
        """This rank's codes (uint8 [rows, in / 2], packed as bitsandbytes packs them) and group
        scales ([rows, in / group]) of the layer's whole modules (``parts``: each one's codes and
        group scales): the layer's own ``loader`` places each module's codes, one a byte, and
        scales (this rank's rows of q / k / v or gate / up, its inputs of o / down)."""
        rows = sum(self.output_partition_sizes)
        codes = torch.empty(rows, self.in_features, dtype=torch.uint8)
        scales = torch.empty(rows, self.in_features // group)
        for index, (packed, module_scales) in enumerate(parts):
            shard_id = self.shard_ids[index] if self.shard_ids else None
            load_rank_part(loader, codes, torch.stack([packed >> 4, packed & 0x0F], dim=-1).flatten(1), shard_id)
            load_rank_part(loader, scales, module_scales, shard_id)
        return [codes[:, 0::2] << 4 | codes[:, 1::2], scales]

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:  # [out, in] float32, bitsandbytes' own
        if self.kernel is not None:
            return self.kernel.dequantize_weight(layer)
        q = layer.qweight
        codes = torch.stack([q >> 4, q & 0x0F], dim=-1).flatten(1).long()  # [out, in]: high nibble first
        parts, row, block = [], 0, 0
        for rows, blocks, blocksize in self.blocks:  # a module's blocks run over its flattened weight
            values = rows * self.in_features
            scale = layer.scales[block : block + blocks].repeat_interleave(blocksize)[:values]
            parts.append(layer.table[codes[row : row + rows].flatten()] * scale)
            row, block = row + rows, block + blocks
        return torch.cat(parts).view(-1, self.in_features)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.apply(layer, x, bias)
        return F.linear(x, self.dequantize_weight(layer).to(x.dtype), bias)

    def bind(self, layer: nn.Module, bias: torch.Tensor | None) -> BoundApply | None:
        return None if self.kernel is None else bound_apply(self.kernel, layer, bias)


class BnB4BitInFlightMethod(BnB4BitMethod):
    """A float checkpoint's weight quantized to NF4 while loading (see the module): each
    checkpoint module (a fused layer's q / k / v, gate / up each, or a tensor fused on disk)
    is placed by the layer's own loader (its rank's rows or inputs) into a float32 weight made
    for that call, quantized, and dropped."""

    def __init__(self, kernel_name: str | None = None) -> None:
        super().__init__("nf4", True, kernel_name)

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        self._note_layer(layer, input_size_per_partition, output_partition_sizes, input_size, output_size)
        if input_size_per_partition % 2:
            raise ConfigError(f"{self.where}: {input_size_per_partition} inputs; bitsandbytes packs two 4-bit codes "
                              "a byte, so quantization='bitsandbytes' needs an even number")
        # A placeholder: each call's float weight is made (and dropped) by the loader below.
        register_weight(layer, "weight", torch.empty(0, dtype=params_dtype),
                        {"output_dim": 0, "input_dim": 1, "weight_loader": self._quantizing_loader})

    def _quantizing_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if not loaded_weight.is_floating_point():
            raise ModelLoadError(f"{self.where}: weight is {loaded_weight.dtype}; quantization='bitsandbytes' "
                                 "quantizes a float checkpoint's weights")
        full = torch.empty(sum(self.output_partition_sizes), self.in_features)  # float32: the checkpoint's values
        load_rank_part(self.layer_loader, full, loaded_weight, shard_id)  # this rank's part
        indices = ([fused_shard_index(self.shard_ids, shard_id, self.where, "bitsandbytes")]
                   if shard_id is not None or not self.shard_ids else range(len(self.shard_ids)))
        starts = [sum(self.output_partition_sizes[:i]) for i in range(len(self.output_partition_sizes))]
        for index in indices:
            rows = full[starts[index] : starts[index] + self.output_partition_sizes[index]]
            if not bool(rows.isfinite().all()):
                raise ModelLoadError(f"{self._shard_name(index)}: the checkpoint's weight holds NaN or infinite "
                                     "values; quantization='bitsandbytes' cannot scale them")
            codes, absmax = quantize_4bit_blocks(rows, torch.tensor(NF4), IN_FLIGHT_BLOCK)
            self.shards[index] = {"codes": codes, "absmax": double_quantize_round_trip(absmax, IN_FLIGHT_NESTED_BLOCK)}

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        missing = [self._shard_name(i) for i in range(len(self.output_partition_sizes)) if i not in self.shards]
        if missing:
            raise ModelLoadError(f"{', '.join(missing)}: the checkpoint has no weight to quantize")
        shards = [(self.shards[i]["codes"], self.shards[i]["absmax"], torch.tensor(NF4), IN_FLIGHT_BLOCK)
                  for i in range(len(self.output_partition_sizes))]
        delattr(layer, "weight")
        self.shards.clear()
        self._hold(layer, shards, whole_modules=False)


def quantize_4bit_blocks(
    weight: torch.Tensor, table: torch.Tensor, blocksize: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [rows, in] (``in`` even) as bitsandbytes' ``quantize_4bit`` quantizes it: blocks
    of ``blocksize`` consecutive values of the flattened weight (the last one shorter where they
    do not tile it), each value times the reciprocal of its block's absmax (the shorter block:
    divided by it, its absmax at least 1e-38), clamped to [-1, 1] and given the index of the
    nearest ``table`` value (16, ascending; a value halfway goes to the lower one). Returns the
    codes (uint8 [rows, in / 2], two a byte, the first in the high nibble) and the absmax values
    (float32 [blocks]). On the CPU through vframe's C++ operator where it builds (the same bits as
    ``quantize_4bit_blocks_torch``, 4 times as fast: 225 against 59 million weights a second on
    2 threads)."""
    from vframe.quant.kernels.builtin import _woq_ops, woq_cpu_available

    flat = weight.reshape(-1).float().contiguous()
    boundaries = ((table[:-1] + table[1:]) / 2).float().contiguous()
    if flat.device.type == "cpu" and woq_cpu_available() is None:
        codes, absmax = _woq_ops().lut4_quantize(flat, boundaries, blocksize)
    else:
        codes, absmax = quantize_4bit_blocks_torch(flat, boundaries, blocksize)
    return codes.view(weight.shape[0], -1), absmax


def quantize_4bit_blocks_torch(
    flat: torch.Tensor, boundaries: torch.Tensor, blocksize: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_4bit_blocks`` in PyTorch: ``flat`` float32 [n], ``boundaries`` the table's 15
    midpoints; codes uint8 [n / 2], absmax float32 [blocks]."""
    full = flat.numel() - flat.numel() % blocksize
    absmax = flat[:full].view(-1, blocksize).abs().amax(dim=1)
    scaled = (flat[:full].view(-1, blocksize) * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp(-1, 1).reshape(-1)
    if full < flat.numel():
        last = flat[full:].abs().amax().clamp(min=1e-38)
        absmax = torch.cat([absmax, last[None]])
        scaled = torch.cat([scaled, (flat[full:] / last).clamp(-1, 1)])
    codes = torch.bucketize(scaled, boundaries).to(torch.uint8)
    return codes[0::2] << 4 | codes[1::2], absmax


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (``create_dynamic_map()``, what double quantization
    codes the absmax values in), float32 [256] ascending: for each e = 0..6, the midpoints of
    2^e + 1 points evenly spaced over [0.1, 1] (float32), times 10^(e - 6), of either sign; and
    0 and 1."""
    values = [0.0, 1.0]
    for e in range(7):
        points = torch.linspace(0.1, 1, 2**e + 1, dtype=torch.float32)
        magnitudes = 10.0 ** (e - 6) * ((points[:-1] + points[1:]) / 2.0)
        values += magnitudes.tolist() + (-magnitudes).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


def double_quantize_round_trip(absmax: torch.Tensor, nested_block: int) -> torch.Tensor:
    """The absmax values bitsandbytes' double quantization keeps, undone (as vLLM's loader
    does once): less their mean, in blocks of ``nested_block`` each value over its block's
    absmax coded as the nearest ``dynamic_map`` entry; then the entry times the block's absmax,
    plus the mean (float32 throughout)."""
    offset, table = absmax.mean(), dynamic_map()
    codes, nested = quantize_blocks_8bit(absmax - offset, table, nested_block)
    return table[codes.long()] * nested.repeat_interleave(nested_block)[: absmax.numel()] + offset


def quantize_blocks_8bit(
    values: torch.Tensor, table: torch.Tensor, blocksize: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` [n] float32 in blocks of ``blocksize`` (the last one shorter), each over its
    block's absmax, as the index of the nearest ``table`` value: uint8 [n], absmax [blocks]."""
    blocks = -(-values.numel() // blocksize)
    padded = F.pad(values, (0, blocks * blocksize - values.numel())).view(blocks, blocksize)
    absmax = padded.abs().amax(dim=1)
    scaled = (padded / absmax.clamp(min=1e-38)[:, None]).clamp(-1, 1).reshape(-1)[: values.numel()]
    return torch.bucketize(scaled, (table[:-1] + table[1:]) / 2).to(torch.uint8), absmax


def _group_scales(absmax: torch.Tensor, rows: int, row_inputs: int, blocksize: int, group: int) -> torch.Tensor:
    """A module's block scales (float32 [blocks], blocks of ``blocksize`` values of its flattened [rows,
    ``row_inputs``] weight) per group of ``group`` inputs of each row (``group`` dividing both): float32
    [rows, row_inputs / group], each group's block's scale."""
    starts = torch.arange(rows)[:, None] * row_inputs + torch.arange(0, row_inputs, group)[None, :]
    return absmax[starts // blocksize]


def _unpack_shard(
    shard: dict[str, torch.Tensor], rows: int | None, in_features: int, quant_type: str, where: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """One checkpoint module's codes (uint8 [rows, in / 2]), block scales (float32 [blocks],
    double quantization undone: a block is ``blocksize`` values of the flattened weight, the
    last one partial where they do not tile it), table (float32 [16]) and block size. ``rows``
    None: as many as its quant state says (a module split across ranks: the layer's loader
    checks them)."""
    needed = {"weight": "weight", "weight_absmax": "weight.absmax", "weight_quant_map": "weight.quant_map",
              "weight_quant_state": f"weight.{_QUANT_STATE}{quant_type}"}
    missing = [checkpoint_name for name, checkpoint_name in needed.items() if name not in shard]
    if missing:
        raise ModelLoadError(f"{where}: the checkpoint lacks its bitsandbytes tensors {', '.join(missing)}")
    try:
        state = json.loads(bytes(shard["weight_quant_state"].to(torch.uint8).numpy()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"{where}: weight.quant_state is not bitsandbytes' JSON ({e})") from None
    if state.get("quant_type") != quant_type:
        raise ModelLoadError(f"{where}: weight.quant_state says quant_type={state.get('quant_type')!r}; "
                             f"quantization_config.bnb_4bit_quant_type is {quant_type!r}")
    shape = state.get("shape")
    if rows is None and isinstance(shape, list) and shape and isinstance(shape[0], int) and shape[0] > 0:
        rows = shape[0]
    if list(shape or []) != [rows, in_features]:
        raise ModelLoadError(f"{where}: weight.quant_state has shape {state.get('shape')}; the layer expects "
                             f"[{'rows' if rows is None else rows}, {in_features}]")
    blocksize = state.get("blocksize")
    if not isinstance(blocksize, int) or blocksize <= 0:
        raise ModelLoadError(f"{where}: weight.quant_state has blocksize={blocksize!r}")
    weight = shard["weight"]
    if weight.dtype != torch.uint8 or in_features % 2 or weight.numel() != rows * in_features // 2:
        raise ModelLoadError(f"{where}: weight is {weight.dtype} of {weight.numel()} values; expected "
                             f"{rows * in_features // 2} uint8 (two 4-bit codes a byte, an even number of inputs)")
    blocks = -(-rows * in_features // blocksize)
    absmax = shard["weight_absmax"].reshape(-1)
    if absmax.numel() != blocks:
        raise ModelLoadError(f"{where}: weight.absmax holds {absmax.numel()} scales for {blocks} blocks")
    if absmax.dtype == torch.uint8:  # double quantization
        if "weight_nested_absmax" not in shard or "weight_nested_quant_map" not in shard:
            raise ModelLoadError(f"{where}: weight.absmax is quantized (uint8) but weight.nested_absmax / "
                                 "nested_quant_map are missing")
        nested_block = state.get("nested_blocksize")
        nested_absmax = shard["weight_nested_absmax"].float().reshape(-1)
        if not isinstance(nested_block, int) or nested_absmax.numel() != -(-blocks // nested_block):
            raise ModelLoadError(f"{where}: weight.nested_absmax holds {nested_absmax.numel()} scales for {blocks} "
                                 f"blocks in nested blocks of {nested_block!r}")
        nested_map = shard["weight_nested_quant_map"].float().reshape(-1)
        offset = torch.tensor(float(state.get("nested_offset", 0.0)), dtype=torch.float32)
        absmax = nested_map[absmax.long()] * nested_absmax.repeat_interleave(nested_block)[:blocks] + offset
    table = shard["weight_quant_map"].float().reshape(-1)
    if table.numel() != 16:
        raise ModelLoadError(f"{where}: weight.quant_map holds {table.numel()} values; a 4-bit table holds 16")
    return weight.reshape(rows, in_features // 2), absmax.float(), table, blocksize


class BnB8BitMethod(IntKernelMethod):
    """LLM.int8's weights as an ``IntWeight``: one symmetric 8-bit group per row, scale ``SCB / 127``."""

    checkpoint_params = ("weight", "SCB", "weight_format")

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        out = sum(output_partition_sizes)
        register_weight(layer, "weight", torch.empty(out, input_size_per_partition, dtype=torch.int8),
                        {"output_dim": 0, "input_dim": 1})
        register_weight(layer, "SCB", torch.empty(out, dtype=torch.float32), {"output_dim": 0, "input_dim": None})
        # one per checkpoint module (a 0-d tensor each): 0 is row-major, the layout bitsandbytes saves
        register_weight(layer, "weight_format", torch.zeros(len(output_partition_sizes), dtype=torch.uint8),
                        {"output_dim": None, "input_dim": None, "weight_loader": _per_shard_loader(layer)})

    def int_weight(self, layer: nn.Module) -> IntWeight:
        if layer.weight_format.any():
            raise ModelLoadError(f"{layer.prefix}: weight_format={layer.weight_format.tolist()}; vframe reads "
                                 "bitsandbytes' row-major int8 weights (0)")
        q = (layer.weight.to(torch.int16) + 128).to(torch.uint8)  # [out, in]: w = scale * (q - 128)
        scales = (layer.SCB.float() / 127)[:, None]  # [out, 1]
        return IntWeight(8, q, scales, None, q.shape[1])
