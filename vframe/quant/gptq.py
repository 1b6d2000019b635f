"""GPTQ checkpoints (``quant_method: gptq``), as AutoGPTQ, GPTQModel and
transformers write them: 2, 3, 4 or 8-bit integer weights, a scale and a zero point
per group of input features, optionally in activation order (``desc_act``).

One layer of ``in`` inputs, ``out`` outputs, ``pack = 32 // bits`` and
``groups = ceil(in / group_size)`` (1 for ``group_size: -1``) stores::

    qweight  int32 [in / pack, out]    word r of column o: inputs r*pack .. r*pack+pack-1 of output o
    qzeros   int32 [groups, out / pack] zero points, packed along the outputs
    (3 bit: 32 values in every 3 words, one 96-bit stream: in * 3 / 32 and out * 3 / 32 words,
    vframe.quant.packing)
    scales   fp16  [groups, out]
    g_idx    int32 [in]                 the group of each input (i // group_size unless desc_act)
    W[o, i] = scales[g, o] * (q[i, o] - zero[g, o])   with g = g_idx[i]

``checkpoint_format: gptq`` (v1, the default, what every tool still saves)
stores each packed zero word minus ``0x11111111`` (4 bit; ``0x01010101`` for
8 bit): GPTQModel subtracts it from the whole int32 when it saves a v1
checkpoint and adds it back when it loads one, so a zero point of 0 borrows
from its neighbour and the round trip is still exact (``gptq_v2`` stores the
zeros as they are). AutoGPTQ wrote ``zero - 1`` value by value, the same
words for every zero point above 0; at 3 bits (AutoGPTQ's and auto-round's
stream) each value is read and one added to it. ``sym`` changes no tensor: a symmetric
checkpoint stores the zero point ``2**(bits - 1)`` everywhere.

``lm_head: true`` quantizes an untied LM head like the other layers, and GPTQModel's
``dynamic`` rules set layers apart by name: ``{"-:.*down_proj": {}}`` leaves the
modules a regex matches float, ``{"+:.*mlp\\..*": {"bits": 8}}`` quantizes them
with other settings; the first rule whose regex matches decides.

After loading, the weight is an ``IntWeight`` (act order kept as ``g_idx``; 2 and 3
bits held as 4-bit integers, their zero points as offsets) and runs on a quant kernel
(``vframe.quant.kernels``; the checkpoint tensors are dropped): on the CPU, torch's int4
kernel (bfloat16) or vframe's weight-only kernel (4 and 8 bit, act order by sorting the
inputs), else the reference.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

from vframe.errors import ConfigError, ModelLoadError
from vframe.layers.linear import LinearBase
from vframe.quant.base import IntKernelMethod, LinearMethodBase, QuantizationConfig, register_weight, setting_of_layer
from vframe.quant.kernels import IntWeight
from vframe.quant.packing import check_divisible, pack_unit, unpack_bits

_FORMATS = ("gptq", "gptq_v2")


class GPTQConfig(QuantizationConfig):
    # Round to nearest moves a weight by at most half a step, and a 4-bit step is
    # at most 2/15 of its group's largest |w|: 1/15. A row-parallel rank holds
    # part of a group under act order (or group_size -1), whose largest |w| may
    # lie on another rank, hence twice that. 8 bit stays far below; 2 and 3 bits:
    # 2 / (2**bits - 1) (set per config, from its bits).
    weight_tolerance = 2 / 15

    def __init__(
        self,
        bits: int,
        group_size: int,
        desc_act: bool,
        sym: bool,
        checkpoint_format: str,
        lm_head: bool = False,
        dynamic: list[tuple[bool, str, dict[str, Any]]] | None = None,
    ) -> None:
        self.bits = bits
        self.weight_tolerance = 2 / (2 ** min(bits, 4) - 1)
        self.group_size = group_size
        self.desc_act = desc_act
        self.sym = sym
        self.checkpoint_format = checkpoint_format
        self.lm_head = lm_head
        # GPTQModel's per-module rules, in order: (quantized, regex, settings); the first match decides
        self.dynamic = dynamic or []

    def __repr__(self) -> str:
        return (
            f"GPTQConfig(bits={self.bits}, group_size={self.group_size}, desc_act={self.desc_act}, "
            f"sym={self.sym}, checkpoint_format={self.checkpoint_format!r}, lm_head={self.lm_head}"
            + (f", dynamic={self.dynamic}" if self.dynamic else "") + ")"
        )

    @classmethod
    def get_name(cls) -> str:
        return "gptq"

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def from_config(cls, hf_quant_config: dict[str, Any] | None) -> GPTQConfig:
        if hf_quant_config is None:
            raise ConfigError(
                "quantization='gptq' reads a GPTQ checkpoint (config.json quantization_config); "
                "this checkpoint is float. Quantize it with GPTQModel first, or use quantization='fp8'"
            )
        q = hf_quant_config
        if q.get("quant_method", "gptq") != "gptq":
            raise ConfigError(
                f"quantization='gptq' reads a GPTQ checkpoint; this one is quantized as {q.get('quant_method')!r}"
            )
        bits, group_size = _bits(q.get("bits"), "bits"), _group_size(q.get("group_size", -1), "group_size")
        checkpoint_format = q.get("checkpoint_format") or "gptq"
        if checkpoint_format not in _FORMATS:
            raise ConfigError(
                f"quantization_config.checkpoint_format={checkpoint_format!r}: vframe reads {', '.join(_FORMATS)}; "
                "convert the checkpoint to the gptq format with GPTQModel"
            )
        if q.get("pack_dtype", "int32") != "int32":
            raise ConfigError(
                f"quantization_config.pack_dtype={q['pack_dtype']!r}: vframe reads GPTQ packed into int32 words"
            )
        return cls(
            bits, group_size, bool(q.get("desc_act", False)), bool(q.get("sym", True)), checkpoint_format,
            lm_head=bool(q.get("lm_head", False)), dynamic=_dynamic_rules(q.get("dynamic") or {}),
        )

    def quantizes_lm_head(self) -> bool:
        # GPTQModel's and auto-round's "lm_head": true (on an untied head), unless a rule excludes it
        return self.lm_head and self._settings_of("lm_head") is not None

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None
        settings = setting_of_layer(prefix, self._settings_of, "quantization_config.dynamic")
        if settings is None:
            return None
        if settings == self._settings():
            return GPTQLinearMethod(self)
        bits, group_size, desc_act, sym = settings
        config = GPTQConfig(bits, group_size, desc_act, sym, self.checkpoint_format)
        config.quant_kernel = self.quant_kernel
        return GPTQLinearMethod(config)

    def _settings(self) -> tuple[int, int, bool, bool]:
        return self.bits, self.group_size, self.desc_act, self.sym

    def _settings_of(self, name: str) -> tuple[int, int, bool, bool] | None:
        """(bits, group_size, desc_act, sym) of checkpoint module ``name``; ``None``:
        a ``-:`` rule left it unquantized."""
        for quantized, pattern, overrides in self.dynamic:
            if re.match(pattern, name):
                if not quantized:
                    return None
                bits, group_size, desc_act, sym = self._settings()
                return (
                    overrides.get("bits", bits), overrides.get("group_size", group_size),
                    overrides.get("desc_act", desc_act), overrides.get("sym", sym),
                )  # fmt: skip
        return self._settings()


# What a dynamic rule may set that changes the stored layout, and what only steered the
# quantization (GPTQModel's QuantizeConfig fields; nothing to read back).
_DYNAMIC_LAYOUT = ("bits", "group_size", "desc_act", "sym")
_DYNAMIC_QUANTIZE_ONLY = ("damp_percent", "damp_auto_increment", "static_groups", "true_sequential", "mse", "v2",
                          "v2_alpha", "act_group_aware")


def _bits(value: object, where: str) -> int:
    if value not in (2, 3, 4, 8) or isinstance(value, bool):
        raise ConfigError(f"quantization_config.{where}={value!r}: vframe serves GPTQ with bits 2, 3, 4 or 8")
    return value  # type: ignore[return-value]


def _group_size(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or (value <= 0 and value != -1):
        raise ConfigError(f"quantization_config.{where}={value!r}: expected a positive integer or -1 (one group)")
    return value


def _dynamic_rules(dynamic: object) -> list[tuple[bool, str, dict[str, Any]]]:
    """GPTQModel's ``dynamic``: ``{"-:regex": {}}`` leaves the modules it matches
    unquantized, ``{"+:regex": {...}}`` (or a bare regex) quantizes them with these
    settings over the config's; the first rule whose regex matches a module's full name
    (``re.match``) decides."""
    if not isinstance(dynamic, dict):
        raise ConfigError(f"quantization_config.dynamic={dynamic!r}: expected an object of regex -> settings")
    rules = []
    for key, overrides in dynamic.items():
        where = f"dynamic[{key!r}]"
        quantized = not key.startswith("-:")
        pattern = key.removeprefix("-:").removeprefix("+:")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"quantization_config.{where}: {pattern!r} is not a regular expression ({e})") from None
        if not isinstance(overrides, dict):
            raise ConfigError(f"quantization_config.{where}={overrides!r}: expected an object of settings")
        unknown = sorted(set(overrides) - {*_DYNAMIC_LAYOUT, *_DYNAMIC_QUANTIZE_ONLY})
        if unknown:
            raise ConfigError(
                f"quantization_config.{where} sets {', '.join(unknown)}: vframe reads {', '.join(_DYNAMIC_LAYOUT)} "
                "per module"
            )
        settings = {field: value for field, value in overrides.items() if field in _DYNAMIC_LAYOUT}
        if "bits" in settings:
            _bits(settings["bits"], f"{where}.bits")
        if "group_size" in settings:
            _group_size(settings["group_size"], f"{where}.group_size")
        settings |= {flag: bool(settings[flag]) for flag in ("desc_act", "sym") if flag in settings}
        rules.append((quantized, pattern, settings))
    return rules


class GPTQLinearMethod(IntKernelMethod):
    checkpoint_params = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, config: GPTQConfig) -> None:
        super().__init__(config.quant_kernel)
        self.config = config

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        bits, group_size = self.config.bits, self.config.group_size
        unit, unit_words = pack_unit(bits)
        where = layer.prefix or type(layer).__name__
        why = f"GPTQ {bits}-bit packs {unit} values per {'int32' if unit_words == 1 else f'{unit_words} int32'}"
        check_divisible(input_size_per_partition, unit, f"{where}: the input size per partition", why)
        for size in output_partition_sizes:
            check_divisible(size, unit, f"{where}: an output shard", why)
        out = sum(output_partition_sizes)

        # Row-parallel ranks cut the groups with the inputs, unless the groups
        # are in activation order (any rank's inputs may use any group) or one.
        split_inputs = input_size_per_partition != input_size
        if group_size == -1:
            num_groups, group_input_dim = 1, None
        elif split_inputs and self.config.desc_act:
            num_groups, group_input_dim = math.ceil(input_size / group_size), None
        else:
            if split_inputs:
                check_divisible(
                    input_size_per_partition, group_size, f"{where}: the input size per partition",
                    f"tensor-parallel ranks split the GPTQ groups of {group_size} inputs",
                )
            num_groups, group_input_dim = math.ceil(input_size_per_partition / group_size), 0
        self.groups_follow_inputs = split_inputs and group_input_dim == 0

        register_weight(
            layer,
            "qweight",
            torch.empty(input_size_per_partition * bits // 32, out, dtype=torch.int32),  # [in / pack, out]
            {"input_dim": 0, "output_dim": 1},
        )
        register_weight(
            layer,
            "qzeros",
            torch.empty(num_groups, out * bits // 32, dtype=torch.int32),  # [groups, out / pack]
            {"input_dim": group_input_dim, "output_dim": 1},
        )
        # float32 holds fp16 and bf16 checkpoint scales exactly.
        register_weight(
            layer,
            "scales",
            torch.empty(num_groups, out, dtype=torch.float32),  # [groups, out]
            {"input_dim": group_input_dim, "output_dim": 1},
        )
        # One row per fused shard: q, k and v (gate, up) were quantized one by
        # one, each with its own activation order.
        num_shards = max(len(layer.shard_ids), 1)
        register_weight(
            layer,
            "g_idx",
            torch.empty(num_shards, input_size_per_partition, dtype=torch.int32),  # [shards, in]
            {"input_dim": 1, "output_dim": None, "weight_loader": _g_idx_loader(layer)},
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.groups_follow_inputs and layer.tp_rank:
            # g_idx names the layer's groups; this rank holds the groups of its inputs only.
            layer.g_idx.data -= layer.tp_rank * (layer.input_size_per_partition // self.config.group_size)
        if int(layer.g_idx.min()) < 0 or int(layer.g_idx.max()) >= layer.scales.shape[0]:
            raise ModelLoadError(
                f"{layer.prefix or type(layer).__name__}: g_idx names groups outside 0 .. {layer.scales.shape[0] - 1}; "
                f"does quantization_config.desc_act={self.config.desc_act} match the checkpoint?"
            )
        super().process_weights_after_loading(layer)

    def int_weight(self, layer: nn.Module) -> IntWeight:
        bits = self.config.bits
        q = unpack_bits(layer.qweight, bits, dim=0).T  # [out, in]
        zeros = _zero_points(layer.qzeros, bits, self.config.checkpoint_format)  # [G, out]
        group_size = layer.input_size_per_partition if self.config.group_size == -1 else self.config.group_size
        g_idx = layer.g_idx.long()  # [shards, in]
        in_order = torch.arange(g_idx.shape[1], device=g_idx.device) // group_size
        if bool((g_idx == in_order).all()):
            g_idx = None
        elif bool((g_idx == g_idx[:1]).all()):
            g_idx = g_idx[0]
        else:  # fused shards quantized each in its own order: one row of groups per output
            sizes = torch.tensor(layer.output_partition_sizes, device=g_idx.device)
            g_idx = g_idx.repeat_interleave(sizes, dim=0)  # [out, in]
        held = max(bits, 4)  # 2 and 3 bits as 4-bit integers (the kernels' widths), w = scale (q - zero) kept
        mid = 1 << (held - 1)
        offsets = None if bool((zeros == mid).all()) else (layer.scales * (mid - zeros)).T.contiguous()
        return IntWeight(held, q.to(torch.uint8), layer.scales.T.contiguous(), offsets, group_size, g_idx)


def _zero_points(qzeros: torch.Tensor, bits: int, checkpoint_format: str) -> torch.Tensor:
    """The zero points [groups, out] (int32) of the packed ``qzeros``: v2 as stored; v1
    (GPTQModel's v1 -> v2) one added to every value of the whole word, carries included,
    at 3 bits (a stream across words) to each value on its own, as it was taken away."""
    if checkpoint_format == "gptq_v2":
        return unpack_bits(qzeros, bits, dim=1)
    if 32 % bits:
        return (unpack_bits(qzeros, bits, dim=1) + 1) & ((1 << bits) - 1)
    ones = sum(1 << shift for shift in range(0, 32, bits))  # 0x11111111 for 4 bit
    return unpack_bits((qzeros.long() + ones) & 0xFFFFFFFF, bits, dim=1)  # int64 words in [0, 2**32)


def _g_idx_loader(layer: LinearBase):
    """Each checkpoint ``g_idx`` [in] is one row of the parameter; a checkpoint
    that stores a fused projection gives every shard the same row."""

    def load(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:
            loaded_weight = loaded_weight.unsqueeze(0).expand(param.shape[0], -1)
        layer.weight_loader(param, loaded_weight, shard_id)

    return load
