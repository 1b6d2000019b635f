"""FP8 (e4m3) weights: quantized while loading a float checkpoint
(``quantization="fp8"``), or read from an FP8 checkpoint (``quant_method: fp8``,
as vLLM's and llm-compressor's per-tensor FP8 checkpoints store it).

Either way the layer ends with::

    weight        float8_e4m3fn [out, in]
    weight_scale  float32       [out]       W[o, i] = weight[o, i] * weight_scale[o]

* On the fly: each output row gets its own scale, ``max |w| / 448`` (448 is
  e4m3's largest value), computed in ``process_weights_after_loading``.
* A checkpoint stores ``weight`` in e4m3 and one float32 ``weight_scale`` per
  tensor (so per q, k and v shard of a fused layer); after loading each shard's
  scale is repeated over its rows. Static ``input_scale`` tensors are read and
  not used: activations stay in the model's dtype (weight-only FP8).

The kernel is the reference: dequantize, then ``F.linear``. Block-wise scales
(``weight_block_size``) are refused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vframe.errors import ConfigError
from vframe.layers.linear import LinearBase
from vframe.quant.base import LinearMethodBase, QuantizationConfig, register_weight

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


class Fp8Config(QuantizationConfig):
    # e4m3 keeps 3 mantissa bits: rounding moves a value by at most 1/16 of its
    # binade's lower end, so by at most 1/16 of the row's largest |w|
    # (1/28 with a scale per row, whose largest value lands on 448).
    weight_tolerance = 1 / 16 + 1e-6

    def __init__(self, is_checkpoint_fp8: bool, activation_scheme: str, ignored_layers: list[str]) -> None:
        self.is_checkpoint_fp8 = is_checkpoint_fp8
        self.activation_scheme = activation_scheme
        self.ignored_layers = ignored_layers

    def __repr__(self) -> str:
        return f"Fp8Config(is_checkpoint_fp8={self.is_checkpoint_fp8}, activation_scheme={self.activation_scheme!r})"

    @classmethod
    def get_name(cls) -> str:
        return "fp8"

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def from_config(cls, hf_quant_config: dict[str, Any] | None) -> Fp8Config:
        if hf_quant_config is None:
            return cls(False, "dynamic", [])
        q = hf_quant_config
        method = q.get("quant_method")
        if method != "fp8":
            raise ConfigError(
                f"quantization='fp8' quantizes float checkpoints or reads FP8 ones; this checkpoint is "
                f"already quantized as {method!r}"
            )
        if q.get("weight_block_size") is not None:
            raise ConfigError(
                f"quantization_config.weight_block_size={q['weight_block_size']!r}: block-wise FP8 scales "
                "are not supported yet; vframe reads per-tensor FP8 checkpoints"
            )
        scheme = q.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ConfigError(f"quantization_config.activation_scheme={scheme!r}: expected 'dynamic' or 'static'")
        ignored = q.get("ignored_layers") or q.get("modules_to_not_convert") or []
        return cls(True, scheme, list(ignored))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if not isinstance(layer, LinearBase) or any(name in prefix for name in self.ignored_layers):
            return None
        return Fp8CheckpointMethod(self) if self.is_checkpoint_fp8 else Fp8OnTheFlyMethod()


class Fp8OnTheFlyMethod(LinearMethodBase):
    """A float checkpoint's weight, quantized to e4m3 with a scale per output row."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        weight = torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype)
        register_weight(layer, "weight", weight, {"output_dim": 0, "input_dim": 1})  # [out, in], quantized after loading

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.float()  # [out, in]
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX  # [out]
        q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        layer.weight = nn.Parameter(q, requires_grad=False)  # [out, in] e4m3
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)  # [out] float32

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.dequantize_weight(layer).to(x.dtype), bias)

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:  # [out, in] float32, exact
        return layer.weight.float() * layer.weight_scale[:, None]


class Fp8CheckpointMethod(Fp8OnTheFlyMethod):
    """An FP8 checkpoint's e4m3 weight and per-tensor scales."""

    def __init__(self, config: Fp8Config) -> None:
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
        weight = torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=FP8_DTYPE)
        register_weight(layer, "weight", weight, {"output_dim": 0, "input_dim": 1})  # [out, in] e4m3
        names = ["weight_scale"] + (["input_scale"] if self.config.activation_scheme == "static" else [])
        for name in names:
            # One scale per fused shard (or the whole layer); checkpoints store each as a scalar.
            scale = torch.empty(len(output_partition_sizes), dtype=torch.float32)
            register_weight(layer, name, scale, {"output_dim": None, "weight_loader": _per_shard_loader(layer)})

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        sizes = torch.tensor(layer.output_partition_sizes, device=layer.weight_scale.device)
        scale = layer.weight_scale.repeat_interleave(sizes)  # [out]
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        layer.input_scale = None  # weight-only: activations are not quantized


def _per_shard_loader(layer: LinearBase):
    """A scalar scale into its fused shard's entry; a fused checkpoint's one scale into every entry."""

    def load(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:
            param.data.copy_(loaded_weight.reshape(-1).expand(param.shape[0]))
        else:
            param.data[layer.shard_ids.index(shard_id)].copy_(loaded_weight.reshape(()))

    return load
