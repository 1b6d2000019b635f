"""AWQ checkpoints (``quant_method: awq``, ``version: gemm``), as AutoAWQ,
GPTQModel and transformers write them: 4-bit weights, a scale and a zero point
per group of input features, packed along the output features.

One layer of ``in`` inputs, ``out`` outputs and ``groups = in / group_size`` stores::

    qweight  int32 [in, out / 8]       word c of row i: outputs 8c .. 8c+7 of input i, interleaved
    qzeros   int32 [groups, out / 8]   zero points, packed the same way (stored as they are)
    scales   fp16  [groups, out]
    W[o, i] = scales[g, o] * (q[i, o] - zero[g, o])   with g = i // group_size

Inside a word, value slot ``j`` (bits ``4j .. 4j+3``) holds output ``8c + ORDER[j]``
with ``ORDER = [0, 2, 4, 6, 1, 3, 5, 7]`` (AutoAWQ's ``AWQ_ORDER``, which its
GEMM kernel reads back with ``AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]``).

After loading, the weight is an ``IntWeight`` and runs on a quant kernel
(``vframe.quant.kernels``; the checkpoint tensors are dropped).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vframe.errors import ConfigError
from vframe.layers.linear import LinearBase
from vframe.quant.base import IntKernelMethod, LinearMethodBase, QuantizationConfig, listed_as_float, register_weight
from vframe.quant.kernels import IntWeight
from vframe.quant.packing import check_divisible, pack_factor, unpack_int32

BITS = 4
# Unpacked slot j of a word holds output ORDER[j]; REVERSE_ORDER[c] is output c's slot.
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


class AWQConfig(QuantizationConfig):
    # Round to nearest moves a weight by at most half a step, at most 1/15 of
    # the group's (so the row's) largest |w| with zero points.
    weight_tolerance = 1 / 15 + 1e-3

    def __init__(self, group_size: int, modules_to_not_convert: list[str]) -> None:
        self.group_size = group_size
        self.modules_to_not_convert = modules_to_not_convert

    def __repr__(self) -> str:
        return f"AWQConfig(group_size={self.group_size}, modules_to_not_convert={self.modules_to_not_convert})"

    @classmethod
    def get_name(cls) -> str:
        return "awq"

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def from_config(cls, hf_quant_config: dict[str, Any] | None) -> AWQConfig:
        if hf_quant_config is None:
            raise ConfigError(
                "quantization='awq' reads an AWQ checkpoint (config.json quantization_config); this checkpoint "
                "is float. Quantize it with AutoAWQ or GPTQModel first, or use quantization='fp8'"
            )
        q = hf_quant_config
        if q.get("quant_method", "awq") != "awq":
            raise ConfigError(
                f"quantization='awq' reads an AWQ checkpoint; this one is quantized as {q.get('quant_method')!r}"
            )
        # transformers' AwqConfig spells bits / group_size, AutoAWQ's own config w_bit / q_group_size.
        bits = q.get("bits", q.get("w_bit"))
        if bits != BITS:
            raise ConfigError(f"quantization_config.bits={bits!r}: vframe serves AWQ with 4 bits")
        group_size = q.get("group_size", q.get("q_group_size"))
        if not isinstance(group_size, int) or group_size <= 0:
            raise ConfigError(f"quantization_config.group_size={group_size!r}: expected a positive integer")
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(
                f"quantization_config.version={q.get('version')!r}: vframe reads the AWQ GEMM layout "
                "(version: gemm); GEMV and other packings differ"
            )
        if not q.get("zero_point", True):
            raise ConfigError("quantization_config.zero_point=false: vframe reads AWQ with zero points only")
        return cls(group_size, list(q.get("modules_to_not_convert") or []))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None
        # AutoAWQ's own test: a module stays float when any listed name is part of its name
        if listed_as_float(prefix, self.modules_to_not_convert, "quantization_config.modules_to_not_convert"):
            return None
        return AWQLinearMethod(self)


class AWQLinearMethod(IntKernelMethod):
    checkpoint_params = ("qweight", "qzeros", "scales")

    def __init__(self, config: AWQConfig) -> None:
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
        group_size = self.config.group_size
        pack = pack_factor(BITS)
        where = layer.prefix or type(layer).__name__
        for size in output_partition_sizes:
            check_divisible(size, pack, f"{where}: an output shard", f"AWQ packs {pack} outputs per int32")
        check_divisible(
            input_size_per_partition, group_size, f"{where}: the input size per partition",
            f"AWQ groups {group_size} inputs",
        )
        out = sum(output_partition_sizes)
        num_groups = input_size_per_partition // group_size
        tensors = {
            "qweight": torch.empty(input_size_per_partition, out // pack, dtype=torch.int32),  # [in, out / 8]
            "qzeros": torch.empty(num_groups, out // pack, dtype=torch.int32),  # [groups, out / 8]
            # float32 holds fp16 and bf16 checkpoint scales exactly.
            "scales": torch.empty(num_groups, out, dtype=torch.float32),  # [groups, out]
        }
        for name, tensor in tensors.items():
            register_weight(layer, name, tensor, {"input_dim": 0, "output_dim": 1})

    def int_weight(self, layer: nn.Module) -> IntWeight:
        q, zeros = _unpack_awq(layer.qweight).T, _unpack_awq(layer.qzeros)  # [out, in], [groups, out]
        offsets = layer.scales * ((1 << (BITS - 1)) - zeros)  # [groups, out]
        return IntWeight(BITS, q.to(torch.uint8), layer.scales.T.contiguous(), offsets.T.contiguous(),
                         self.config.group_size)


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:  # [rows, out / 8] -> [rows, out] int32
    slots = unpack_int32(packed, BITS, dim=1)  # [rows, out], output 8c + j in slot order
    reverse = torch.tensor(REVERSE_ORDER, device=packed.device)
    index = (torch.arange(packed.shape[1], device=packed.device)[:, None] * 8 + reverse).flatten()  # [out]
    return slots[:, index]
