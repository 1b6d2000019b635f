"""FP8 (e4m3) weights: quantized while loading a float checkpoint
(``quantization="fp8"``), or read from an FP8 checkpoint (``quant_method: fp8``,
as vLLM's and llm-compressor's per-tensor FP8 checkpoints store it, or with
block-wise scales as DeepSeek-V3's does).

Per-tensor and on the fly, the layer ends with::

    weight        float8_e4m3fn [out, in]
    weight_scale  float32       [out]       W[o, i] = weight[o, i] * weight_scale[o]

* On the fly: each output row gets its own scale, ``max |w| / 448`` (448 is
  e4m3's largest value), computed in ``process_weights_after_loading``.
* A checkpoint stores ``weight`` in e4m3 and one float32 ``weight_scale`` per
  tensor (so per q, k and v shard of a fused layer); after loading each shard's
  scale is repeated over its rows. Static ``input_scale`` tensors are read and
  not used: activations stay in the model's dtype (weight-only FP8).
* Block-wise (``weight_block_size: [bn, bk]``, DeepSeek-V3: ``[128, 128]``):
  one scale per ``bn x bk`` block, named ``weight_scale_inv`` though it
  multiplies. A tensor whose sizes ``bn`` / ``bk`` do not divide ends in partial
  blocks with scales of their own (llm-compressor pads the weight with zeros
  to whole blocks, quantizes, and cuts the padding off)::

      weight            e4m3    [out, in]
      weight_scale_inv  float32 [ceil(out / bn), ceil(in / bk)]
      W[o, i] = weight[o, i] * scale[o // bn, i // bk]

  A fused layer keeps each shard's block rows (``BlockFp8Method``): q's last
  partial block and k's first are different blocks.

After loading, every method hands its layer's weight to a quant kernel as an
``Fp8Weight`` (``vframe.quant.kernels``, plugin API 1.10: ``e4m3(q) * scales`` with a
scale per output row, or per row and block of ``bk`` inputs): on the CPU ``fp8_cpu``
(vframe's C++ operator, the e4m3 bytes read in place), elsewhere the reference
(dequantize, then ``F.linear``). The kernel's buffers share the layer's ``weight``
(and per-row ``weight_scale``) storage: nothing is held twice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vframe.errors import ConfigError, ModelLoadError
from vframe.layers.linear import LinearBase
from vframe.quant.base import (
    BoundApply, LinearMethodBase, QuantizationConfig, bound_apply, listed_as_float, register_weight,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


class Fp8Config(QuantizationConfig):
    # e4m3 keeps 3 mantissa bits: rounding moves a value by at most 1/16 of its
    # binade's lower end, so by at most 1/16 of the row's largest |w|
    # (1/28 with a scale per row, whose largest value lands on 448).
    weight_tolerance = 1 / 16 + 1e-6

    def __init__(
        self,
        is_checkpoint_fp8: bool,
        activation_scheme: str,
        ignored_layers: list[str],
        weight_block_size: tuple[int, int] | None = None,
    ) -> None:
        self.is_checkpoint_fp8 = is_checkpoint_fp8
        self.activation_scheme = activation_scheme
        self.ignored_layers = ignored_layers
        self.weight_block_size = weight_block_size

    def __repr__(self) -> str:
        return (
            f"Fp8Config(is_checkpoint_fp8={self.is_checkpoint_fp8}, activation_scheme={self.activation_scheme!r}, "
            f"weight_block_size={self.weight_block_size})"
        )

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
        scheme = q.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ConfigError(f"quantization_config.activation_scheme={scheme!r}: expected 'dynamic' or 'static'")
        block = q.get("weight_block_size")
        if block is not None:
            block = block_structure(block, "quantization_config.weight_block_size")
            if scheme != "dynamic":
                raise ConfigError(
                    f"quantization_config.activation_scheme={scheme!r} with weight_block_size: block-wise FP8 "
                    "checkpoints have dynamic activations; expected 'dynamic'"
                )
        ignored = q.get("ignored_layers") or q.get("modules_to_not_convert") or []
        return cls(True, scheme, list(ignored), block)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None
        if listed_as_float(prefix, self.ignored_layers, "quantization_config.ignored_layers"):
            return None
        if self.weight_block_size is not None:
            return BlockFp8Method(self.weight_block_size, "weight_scale_inv", self.quant_kernel)
        if self.is_checkpoint_fp8:
            return Fp8CheckpointMethod(self, self.quant_kernel)
        return Fp8OnTheFlyMethod(self.quant_kernel)


class Fp8KernelMethod(LinearMethodBase):
    """An FP8 layer on a quant kernel: after loading, ``attach_kernel`` hands
    ``fp8_weight(layer)`` to the kernel the ``quant_kernel`` setting names, else the one
    chosen by priority (``fp8_pairs`` in bfloat16 on CPUs with AVX512-BF16, ``fp8_cpu`` on
    the CPU). A kernel that keeps the checkpoint's bytes as they are (``fp8_cpu``) shares
    them; one that lays them out anew (``fp8_pairs``) leaves the checkpoint's parameters
    to be dropped, and the weight is the kernel's from then on (``dequantize_weight``).
    Subclasses define ``checkpoint_weight``: the exact float weight of the loaded tensors."""

    kernel: Any = None  # vframe.quant.kernels.QuantLinearKernel, once loaded

    def __init__(self, kernel_name: str | None = None) -> None:
        self.kernel_name = kernel_name

    def fp8_weight(self, layer: nn.Module) -> Any:  # vframe.quant.kernels.Fp8Weight
        """The loaded weight: e4m3 ``weight`` with one float32 ``weight_scale`` per row."""
        from vframe.quant.kernels import Fp8Weight

        return Fp8Weight(layer.weight.view(torch.uint8), layer.weight_scale[:, None], layer.input_size_per_partition)

    def attach_kernel(self, layer: nn.Module) -> None:
        from vframe.quant.kernels import attach_kernel

        self.kernel = attach_kernel(layer, self.fp8_weight(layer), name=self.kernel_name)
        storage = layer.weight.untyped_storage().data_ptr()
        if not any(buffer.untyped_storage().data_ptr() == storage for buffer in layer.buffers(recurse=False)):
            for name in [n for n in layer._parameters if n != "bias"]:  # the kernel holds the weight now
                delattr(layer, name)

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:  # [out, in] float32, exact
        if "weight" not in layer._parameters:  # dropped: the kernel's
            return self.kernel.dequantize_weight(layer)
        return self.checkpoint_weight(layer)

    def checkpoint_weight(self, layer: nn.Module) -> torch.Tensor:  # [out, in] float32, exact
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel is None:  # not loaded yet
            return F.linear(x, self.dequantize_weight(layer).to(x.dtype), bias)
        return self.kernel.apply(layer, x, bias)

    def bind(self, layer: nn.Module, bias: torch.Tensor | None) -> BoundApply | None:
        return None if self.kernel is None else bound_apply(self.kernel, layer, bias)


class Fp8OnTheFlyMethod(Fp8KernelMethod):
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
        self.attach_kernel(layer)

    def checkpoint_weight(self, layer: nn.Module) -> torch.Tensor:  # [out, in] float32, exact
        return layer.weight.float() * layer.weight_scale[:, None]


class Fp8CheckpointMethod(Fp8OnTheFlyMethod):
    """An FP8 checkpoint's e4m3 weight and per-tensor scales."""

    def __init__(self, config: Fp8Config, kernel_name: str | None = None) -> None:
        super().__init__(kernel_name)
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
        scale = over_shard_rows(layer, layer.weight_scale)  # [out]
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        layer.input_scale = None  # weight-only: activations are not quantized
        self.attach_kernel(layer)


class BlockFp8Method(Fp8KernelMethod):
    """e4m3 weights with one scale per ``bn x bk`` block, kept per fused shard.

    The scale parameter (``scale_name``: ``weight_scale_inv`` in ``quant_method:
    fp8`` checkpoints, ``weight_scale`` in compressed-tensors ones) stacks the
    shards' block rows: ``[sum(ceil(shard_out / bn)), ceil(in / bk)]``.
    Tensor-parallel ranks must cut whole blocks."""

    def __init__(self, block: tuple[int, int], scale_name: str, kernel_name: str | None = None) -> None:
        super().__init__(kernel_name)
        self.block = block
        self.scale_name = scale_name

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        block_n, block_k = self.block
        where = layer.prefix or type(layer).__name__
        if input_size_per_partition != input_size and input_size_per_partition % block_k:
            raise ConfigError(
                f"{where}: {input_size_per_partition} inputs per tensor-parallel rank do not fill whole FP8 "
                f"blocks of {block_k}; use a tensor-parallel size whose share of {input_size} inputs {block_k} divides"
            )
        if sum(output_partition_sizes) != output_size and any(size % block_n for size in output_partition_sizes):
            raise ConfigError(
                f"{where}: output shards of {output_partition_sizes} per tensor-parallel rank do not fill whole "
                f"FP8 blocks of {block_n}; use a tensor-parallel size that splits each projection into whole blocks"
            )
        out = sum(output_partition_sizes)
        register_weight(layer, "weight", torch.empty(out, input_size_per_partition, dtype=FP8_DTYPE),
                        {"output_dim": 0, "input_dim": 1})  # [out, in] e4m3
        rows = sum(_cdiv(size, block_n) for size in output_partition_sizes)
        scale = torch.empty(rows, _cdiv(input_size_per_partition, block_k), dtype=torch.float32)
        register_weight(layer, self.scale_name, scale,  # [shard block rows, in blocks]
                        {"output_dim": None, "weight_loader": _block_scale_loader(layer, self.block)})

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.attach_kernel(layer)

    def fp8_weight(self, layer: nn.Module) -> Any:  # vframe.quant.kernels.Fp8Weight
        """Each row with its shard's block-row scales: [out, ceil(in / bk)], groups of bk."""
        from vframe.quant.kernels import Fp8Weight

        block_n, block_k = self.block
        scale, parts, row = getattr(layer, self.scale_name), [], 0
        for size in layer.output_partition_sizes:
            rows = _cdiv(size, block_n)
            parts.append(scale[row : row + rows].repeat_interleave(block_n, dim=0)[:size])
            row += rows
        return Fp8Weight(layer.weight.view(torch.uint8), torch.cat(parts).float(), block_k)

    def checkpoint_weight(self, layer: nn.Module) -> torch.Tensor:  # [out, in] float32, exact
        return dequantize_blocks(layer.weight, getattr(layer, self.scale_name), self.block, layer.output_partition_sizes)


def dequantize_blocks(
    weight: torch.Tensor,  # [out, in] e4m3
    scale: torch.Tensor,  # [sum(ceil(shard_out / bn)), ceil(in / bk)]
    block: tuple[int, int],
    shard_sizes: list[int],
) -> torch.Tensor:  # [out, in] float32
    """Each shard's rows times its own block scales, partial blocks cut off."""
    block_n, block_k = block
    inputs = weight.shape[1]
    parts, row = [], 0
    for w, size in zip(weight.split(shard_sizes), shard_sizes, strict=True):
        rows = _cdiv(size, block_n)
        s = scale[row : row + rows].repeat_interleave(block_n, dim=0)[:size]  # [size, in blocks]
        parts.append(w.float() * s.repeat_interleave(block_k, dim=1)[:, :inputs])
        row += rows
    return torch.cat(parts)


def block_structure(value: Any, field: str) -> tuple[int, int]:
    """``[bn, bk]`` from a config field, checked."""
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise ConfigError(f"{field}={value!r}: expected two positive integers [rows, columns], e.g. [128, 128]")
    return int(value[0]), int(value[1])


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_scale_loader(layer: LinearBase, block: tuple[int, int]):
    """A shard's block scales ``[ceil(shard_out / bn), ceil(in / bk)]`` into its rows
    of the stacked parameter; a rank takes its own (whole) blocks."""
    block_n, block_k = block

    def load(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        sizes = layer.output_partition_sizes
        where = layer.prefix or type(layer).__name__
        if shard_id is None and len(sizes) > 1:
            # A checkpoint that stores the fused layer: its blocks run across shard boundaries
            # unless every shard is whole blocks.
            if any(size % block_n for size in sizes) or layer.tp_size > 1:
                raise ModelLoadError(
                    f"{where}: a fused FP8 block scale of shape {tuple(loaded_weight.shape)} cannot be split into "
                    f"shards of {sizes} rows, which blocks of {block_n} do not divide; store the projections apart"
                )
            for sid, part in zip(layer.shard_ids, loaded_weight.split([s // block_n for s in sizes]), strict=True):
                load(param, part, sid)
            return
        index = 0 if shard_id is None else layer.shard_ids.index(shard_id)
        rows = _cdiv(sizes[index], block_n)
        start = sum(_cdiv(size, block_n) for size in sizes[:index])
        if hasattr(layer, "_shard_layout"):  # column-parallel: this rank's whole blocks of the shard
            _, _, src_index, num_src = layer._shard_layout(shard_id)
            if num_src > 1:
                loaded_weight = loaded_weight.narrow(0, src_index * rows, rows)
        if layer.input_size_per_partition != layer.input_size:  # row-parallel: this rank's block columns
            cols = param.shape[1]
            loaded_weight = loaded_weight.narrow(1, layer.tp_rank * cols, cols)
        target = param.data[start : start + rows]
        if target.shape != loaded_weight.shape:
            raise ModelLoadError(
                f"{where}: FP8 block scale has shape {tuple(loaded_weight.shape)}, the model expects "
                f"{tuple(target.shape)} (blocks of {block_n} x {block_k})"
            )
        target.copy_(loaded_weight)

    return load


def over_shard_rows(layer: LinearBase, values: torch.Tensor) -> torch.Tensor:  # [out]
    """One value per fused shard (what ``_per_shard_loader`` fills), repeated over that
    shard's output rows."""
    sizes = torch.tensor(layer.output_partition_sizes, device=values.device)
    return values.repeat_interleave(sizes)


def _per_shard_loader(layer: LinearBase):
    """A scalar scale into its fused shard's entry; a fused checkpoint's one scale into every entry."""

    def load(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:
            param.data.copy_(loaded_weight.reshape(-1).expand(param.shape[0]))
        else:
            param.data[layer.shard_ids.index(shard_id)].copy_(loaded_weight.reshape(()))

    return load
