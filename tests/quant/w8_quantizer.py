"""A worked quantizer that the tests register as ``"w8-test"``; not a built-in.

Int8 weight-only, per output channel, symmetric round-to-nearest, quantized
while loading a float checkpoint: each row ``w`` of a weight is stored as
``q = round(w / s)`` in int8 with ``s = max|w| / 127`` in the model's dtype,
so ``|w - q * s| <= s / 2 = max|w| / 254``. Activations stay float:
``apply`` computes ``(x @ q.T) * s + b``, which is ``x @ (q * s).T + b``.
Weights take a quarter of float32's memory (half of bfloat16's).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vframe.errors import ConfigError
from vframe.layers.linear import LinearBase
from vframe.plugins import hookimpl
from vframe.quant.base import LinearMethodBase, QuantizationConfig, register_weight

NAME = "w8-test"
_HAS_INT8PACK_MM = hasattr(torch, "_weight_int8pack_mm")


class W8Config(QuantizationConfig):
    reference_tolerance = 1e-5  # float32 rounding of the matmul, the scale applied after it
    weight_tolerance = 1 / 254 + 1e-6  # round-to-nearest: half a step of max|w| / 127

    @classmethod
    def get_name(cls) -> str:
        return NAME

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16]

    @classmethod
    def from_config(cls, hf_quant_config: dict[str, Any] | None) -> W8Config:
        if hf_quant_config is not None:
            raise ConfigError(
                f"quantization={NAME!r} quantizes float checkpoints while loading; this checkpoint is "
                f"already quantized ({hf_quant_config.get('quant_method')!r})"
            )
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        return W8LinearMethod() if isinstance(layer, LinearBase) else None


class W8LinearMethod(LinearMethodBase):
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        # The checkpoint's float weight lands here; process_weights_after_loading quantizes it.
        weight = torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype)
        register_weight(layer, "weight", weight, {"output_dim": 0, "input_dim": 1})  # [out, in]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.float()  # [out, in]
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # [out]
        scale = scale.to(layer.weight.dtype)  # the scale apply multiplies by, rounded once here
        q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        layer.weight = nn.Parameter(q, requires_grad=False)  # [out, in] int8
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)  # [out]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and x.device.type == "cpu" and _HAS_INT8PACK_MM:
            # oneDNN int8-weight kernel: ~4x faster than a cast at decode batch sizes.
            out = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), layer.weight, layer.weight_scale)
            out = out.view(*x.shape[:-1], -1)
        else:
            out = F.linear(x, layer.weight.to(x.dtype)) * layer.weight_scale
        return out if bias is None else out + bias

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float() * layer.weight_scale.float()[:, None]  # exact in float32


class W8Plugin:
    """What an installed package's entry point would name."""

    VFRAME_PLUGIN_API = "1.2"

    @staticmethod
    @hookimpl
    def vframe_register_quantizers(register) -> None:
        register(NAME, W8Config)
