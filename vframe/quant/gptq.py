"""GPTQ checkpoints (``quant_method: gptq``), as AutoGPTQ, GPTQModel and
transformers write them: 4 or 8-bit integer weights, a scale and a zero point
per group of input features, optionally in activation order (``desc_act``).

One layer of ``in`` inputs, ``out`` outputs, ``pack = 32 // bits`` and
``groups = ceil(in / group_size)`` (1 for ``group_size: -1``) stores::

    qweight  int32 [in / pack, out]    word r of column o: inputs r*pack .. r*pack+pack-1 of output o
    qzeros   int32 [groups, out / pack] zero points, packed along the outputs
    scales   fp16  [groups, out]
    g_idx    int32 [in]                 the group of each input (i // group_size unless desc_act)
    W[o, i] = scales[g, o] * (q[i, o] - zero[g, o])   with g = g_idx[i]

``checkpoint_format: gptq`` (v1, the default, what every tool still saves)
stores each packed zero word minus ``0x11111111`` (4 bit; ``0x01010101`` for
8 bit): GPTQModel subtracts it from the whole int32 when it saves a v1
checkpoint and adds it back when it loads one, so a zero point of 0 borrows
from its neighbour and the round trip is still exact (``gptq_v2`` stores the
zeros as they are). AutoGPTQ wrote ``zero - 1`` value by value, the same
words for every zero point above 0. ``sym`` changes no tensor: a symmetric
checkpoint stores the zero point ``2**(bits - 1)`` everywhere.

After loading, the weight is an ``IntWeight`` (act order kept as ``g_idx``) and
runs on a quant kernel (``vframe.quant.kernels``; the checkpoint tensors are
dropped): on the CPU, torch's int4 kernel (bfloat16) or vframe's weight-only
kernel (4 and 8 bit, act order by sorting the inputs), else the reference.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from vframe.errors import ConfigError, ModelLoadError
from vframe.layers.linear import LinearBase
from vframe.quant.base import IntKernelMethod, LinearMethodBase, QuantizationConfig, register_weight
from vframe.quant.kernels import IntWeight
from vframe.quant.packing import check_divisible, pack_factor, unpack_int32

_FORMATS = ("gptq", "gptq_v2")


class GPTQConfig(QuantizationConfig):
    # Round to nearest moves a weight by at most half a step, and a 4-bit step is
    # at most 2/15 of its group's largest |w|: 1/15. A row-parallel rank holds
    # part of a group under act order (or group_size -1), whose largest |w| may
    # lie on another rank, hence twice that. 8 bit stays far below.
    weight_tolerance = 2 / 15

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, checkpoint_format: str) -> None:
        self.bits = bits
        self.group_size = group_size
        self.desc_act = desc_act
        self.sym = sym
        self.checkpoint_format = checkpoint_format

    def __repr__(self) -> str:
        return (
            f"GPTQConfig(bits={self.bits}, group_size={self.group_size}, desc_act={self.desc_act}, "
            f"sym={self.sym}, checkpoint_format={self.checkpoint_format!r})"
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
        bits = q.get("bits")
        if bits not in (4, 8):
            raise ConfigError(f"quantization_config.bits={bits!r}: vframe serves GPTQ with bits 4 or 8")
        group_size = q.get("group_size", -1)
        if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
            raise ConfigError(
                f"quantization_config.group_size={group_size!r}: expected a positive integer or -1 (one group)"
            )
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
        if q.get("dynamic"):
            raise ConfigError(
                "quantization_config.dynamic (per-module GPTQ settings) is not supported yet; "
                "use a checkpoint quantized with one setting for every layer"
            )
        if q.get("lm_head"):
            raise ConfigError("quantization_config.lm_head=true: vframe keeps the LM head unquantized")
        return cls(bits, group_size, bool(q.get("desc_act", False)), bool(q.get("sym", True)), checkpoint_format)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        return GPTQLinearMethod(self) if isinstance(layer, LinearBase) else None


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
        pack = pack_factor(bits)
        where = layer.prefix or type(layer).__name__
        why = f"GPTQ {bits}-bit packs {pack} values per int32"
        check_divisible(input_size_per_partition, pack, f"{where}: the input size per partition", why)
        for size in output_partition_sizes:
            check_divisible(size, pack, f"{where}: an output shard", why)
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
            torch.empty(input_size_per_partition // pack, out, dtype=torch.int32),  # [in / pack, out]
            {"input_dim": 0, "output_dim": 1},
        )
        register_weight(
            layer,
            "qzeros",
            torch.empty(num_groups, out // pack, dtype=torch.int32),  # [groups, out / pack]
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
        q = unpack_int32(layer.qweight, bits, dim=0).T  # [out, in]
        zeros = unpack_int32(_v2_zeros(layer.qzeros, bits, self.config.checkpoint_format), bits, dim=1)  # [G, out]
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
        mid = 1 << (bits - 1)
        offsets = None if bool((zeros == mid).all()) else (layer.scales * (mid - zeros)).T.contiguous()
        return IntWeight(bits, q.to(torch.uint8), layer.scales.T.contiguous(), offsets, group_size, g_idx)


def _v2_zeros(qzeros: torch.Tensor, bits: int, checkpoint_format: str) -> torch.Tensor:
    """The zero points' words as v2 stores them (GPTQModel's v1 -> v2: add one to
    every value of the whole word, carries included)."""
    if checkpoint_format == "gptq_v2":
        return qzeros
    ones = sum(1 << shift for shift in range(0, 32, bits))  # 0x11111111 for 4 bit
    return (qzeros.long() + ones) & 0xFFFFFFFF  # int64 words in [0, 2**32)


def _g_idx_loader(layer: LinearBase):
    """Each checkpoint ``g_idx`` [in] is one row of the parameter; a checkpoint
    that stores a fused projection gives every shard the same row."""

    def load(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:
            loaded_weight = loaded_weight.unsqueeze(0).expand(param.shape[0], -1)
        layer.weight_loader(param, loaded_weight, shard_id)

    return load
