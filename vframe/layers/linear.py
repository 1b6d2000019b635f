"""vframe's linear layers: the one place where quantization, tensor parallelism
(and later LoRA) meet (DESIGN.md §9).

A layer knows its shard of the weight (``tp_rank`` of ``tp_size``; 0 of 1 until
tensor parallelism is wired, see ``parallel.py``) and hands everything about
the weight to its quantization method (``vframe.quant.base``): the method
creates the parameters, the layer's ``weight_loader`` cuts each checkpoint
tensor to this rank's part and places it, the method post-processes and
computes ``apply(x)``::

    ColumnParallelLinear   x [T, in]      -> [T, out / tp]        W cut along its output rows
    RowParallelLinear      x [T, in / tp] -> [T, out], summed     W cut along its input columns
    ReplicatedLinear       x [T, in]      -> [T, out]             every rank holds all of W

Fused projections are column-parallel layers whose output is several
checkpoint tensors side by side; ``shard_ids`` names them and the model's
``load_weights`` passes the id with each tensor::

    QKVParallelLinear            [ q | k | v ]   shard ids "q", "k", "v" (k, v: fewer heads under GQA)
    MergedColumnParallelLinear   [ gate | up ]   shard ids 0, 1, ...

The token embedding and the LM head are not here: models keep ``nn.Embedding``
and an unquantized ``ReplicatedLinear`` head; vocabulary-parallel versions of
both come with tensor parallelism.
"""

from __future__ import annotations

import torch
from torch import nn

from vframe.errors import ModelLoadError
from vframe.layers.parallel import all_reduce, divide, get_tp_rank, get_tp_size
from vframe.quant.base import (
    BoundApply, LinearMethodBase, QuantizationConfig, UnquantizedLinearMethod, bound_apply, set_weight_attrs,
)

ShardId = str | int


class LinearBase(nn.Module):
    """``y = x W^T + b`` with ``W`` owned by a quantization method.

    Subclasses set ``input_size_per_partition`` and ``output_partition_sizes``
    (this rank's features of each fused shard) and then call ``_create_weights``."""

    input_size_per_partition: int
    output_partition_sizes: list[int]
    shard_ids: tuple[ShardId, ...] = ()  # fused shards, loaded one checkpoint tensor each
    quant_method: LinearMethodBase
    _bound: BoundApply | None = None  # what forward calls once bound (bind_forward)

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.prefix = prefix
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tp_size() if tp_size is None else tp_size
        assert 0 <= self.tp_rank < self.tp_size, (self.tp_rank, self.tp_size)

    @property
    def output_size_per_partition(self) -> int:
        return sum(self.output_partition_sizes)

    def _create_weights(self, quant_config: QuantizationConfig | None, bias_size: int | None) -> None:
        method = quant_config.get_quant_method(self, self.prefix) if quant_config is not None else None
        self.quant_method = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(
            self,
            self.input_size_per_partition,
            list(self.output_partition_sizes),
            self.input_size,
            self.output_size,
            self.params_dtype,
        )
        if bias_size is None:
            self.register_parameter("bias", None)
        else:
            bias = nn.Parameter(torch.empty(bias_size, dtype=self.params_dtype), requires_grad=False)
            set_weight_attrs(bias, {"output_dim": 0})
            self.bias = bias
        for param in self.parameters(recurse=False):
            if not hasattr(param, "weight_loader"):
                param.weight_loader = self.weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out / tp]
        bound = self._bound
        if bound is not None:
            return bound(x)
        return self.quant_method.apply(self, x, self.bias)

    def bind_forward(self, enabled: bool = True) -> None:
        """Once the weights are processed (``vframe.layers.binding``): ``forward`` calls what
        the quant method's ``bind`` returns, the layer's tensors looked up once; with
        ``enabled=False`` (or a method that does not bind) its ``apply`` again."""
        self._bound = bound_apply(self.quant_method, self, self.bias) if enabled else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None) -> None:
        """Place the checkpoint tensor ``loaded_weight`` (of shard ``shard_id`` of a
        fused layer) into ``param``, keeping this rank's part."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size_per_partition}, out={self.output_partition_sizes}, "
            f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}, "
            f"method={type(self.quant_method).__name__}"
        )


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight and computes the whole output."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__(
            input_size, output_size, prefix=prefix, params_dtype=params_dtype, tp_rank=tp_rank, tp_size=tp_size
        )
        self.input_size_per_partition = input_size
        self.output_partition_sizes = [output_size]
        self._create_weights(quant_config, output_size if bias else None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None) -> None:
        _refuse_shard_id(self, shard_id)
        _copy(param.data, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks: this rank computes ``output_size / tp_size``
    of them from the whole input; its output stays split."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__(
            input_size, output_size, prefix=prefix, params_dtype=params_dtype, tp_rank=tp_rank, tp_size=tp_size
        )
        self.input_size_per_partition = input_size
        self.output_partition_sizes = self._split_output()
        self._create_weights(quant_config, self.output_size_per_partition if bias else None)

    def _split_output(self) -> list[int]:
        return [divide(self.output_size, self.tp_size, f"{self.prefix or 'a layer'}: output size {self.output_size}")]

    def _shard_layout(self, shard_id: ShardId | None) -> tuple[int, int, int, int]:
        """``(offset, size)`` of the shard in this rank's output features, then which
        slice of the checkpoint tensor this rank takes, of how many."""
        _refuse_shard_id(self, shard_id)
        return 0, self.output_size_per_partition, self.tp_rank, self.tp_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None) -> None:
        dim = getattr(param, "output_dim", None)
        if shard_id is None and self.shard_ids:
            # The checkpoint stores the shards already fused: load them one by one.
            if dim is None:
                _copy(param.data, loaded_weight)
                return
            layouts = [self._shard_layout(s) for s in self.shard_ids]
            extent = param.shape[dim]
            sizes = [_scaled(size * num_src, extent, self.output_size_per_partition) for _, size, _, num_src in layouts]
            if loaded_weight.shape[dim] != sum(sizes):
                raise ModelLoadError(_shape_message(loaded_weight, dim, sum(sizes)))
            for sid, part in zip(self.shard_ids, loaded_weight.split(sizes, dim=dim), strict=True):
                self.weight_loader(param, part, sid)
            return
        offset, size, src_index, num_src = self._shard_layout(shard_id)
        if dim is None:
            # Not along the output features: one entry per fused shard (or the whole tensor).
            _copy(param.data if shard_id is None else param.data[self.shard_ids.index(shard_id)], loaded_weight)
            return
        extent = param.shape[dim]
        start = _scaled(offset, extent, self.output_size_per_partition)
        length = _scaled(size, extent, self.output_size_per_partition)
        if loaded_weight.shape[dim] != length * num_src:
            raise ModelLoadError(_shape_message(loaded_weight, dim, length * num_src))
        _copy(param.data.narrow(dim, start, length), loaded_weight.narrow(dim, src_index * length, length))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one
    matmul, e.g. ``[gate | up]`` of a SwiGLU MLP; shard ``i`` is ``output_sizes[i]``."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool = True,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)  # before nn.Module's init: _split_output reads it
        self.shard_ids = tuple(range(len(output_sizes)))
        super().__init__(
            input_size,
            sum(output_sizes),
            bias=bias,
            quant_config=quant_config,
            prefix=prefix,
            params_dtype=params_dtype,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    def _split_output(self) -> list[int]:
        where = self.prefix or "a merged layer"
        return [
            divide(size, self.tp_size, f"{where}: output size {size} of shard {i}")
            for i, size in enumerate(self.output_sizes)
        ]

    def _shard_layout(self, shard_id: ShardId | None) -> tuple[int, int, int, int]:
        if shard_id not in self.shard_ids:
            raise ValueError(
                f"{type(self).__name__} {self.prefix!r}: shard id {shard_id!r} is not one of {self.shard_ids}"
            )
        i = int(shard_id)  # type: ignore[arg-type]
        sizes = self.output_partition_sizes
        return sum(sizes[:i]), sizes[i], self.tp_rank, self.tp_size

    def silu_pairs(self) -> torch.Tensor | None:
        """The weight, held as ``cpu_ops.bf16_pairs``, when this layer is an unquantized
        ``[gate; up]`` pair of equal shards without bias that ``cpu_ops.bf16_gemm_silu``
        takes whole (each shard a multiple of 16 features); else None."""
        weight, sizes = getattr(self, "weight", None), self.output_partition_sizes
        if (
            type(self.quant_method) is UnquantizedLinearMethod and self.bias is None
            and isinstance(weight, torch.Tensor) and weight.dim() == 4
            and len(sizes) == 2 and sizes[0] == sizes[1] and sizes[0] % 16 == 0
        ):  # fmt: skip
            return weight
        return None


class QKVParallelLinear(ColumnParallelLinear):
    """The fused ``[q | k | v]`` projection of attention, split over ranks by heads.

    With grouped-query attention k and v have ``total_num_kv_heads`` heads; when
    there are more ranks than kv heads, each kv head is replicated on
    ``num_kv_head_replicas`` consecutive ranks."""

    shard_ids = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        *,
        bias: bool = True,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        self.head_size = head_size  # before nn.Module's init: _split_output reads these
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        super().__init__(
            hidden_size,
            (self.total_num_heads + 2 * self.total_num_kv_heads) * head_size,
            bias=bias,
            quant_config=quant_config,
            prefix=prefix,
            params_dtype=params_dtype,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    def _split_output(self) -> list[int]:
        self.num_heads = divide(self.total_num_heads, self.tp_size, f"num_attention_heads={self.total_num_heads}")
        if self.tp_size >= self.total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(
                self.tp_size, self.total_num_kv_heads, f"num_key_value_heads={self.total_num_kv_heads}: replicas of"
            )
        else:
            self.num_kv_heads = divide(
                self.total_num_kv_heads, self.tp_size, f"num_key_value_heads={self.total_num_kv_heads}"
            )
            self.num_kv_head_replicas = 1
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        return [self.q_size, self.kv_size, self.kv_size]

    def _shard_layout(self, shard_id: ShardId | None) -> tuple[int, int, int, int]:
        if shard_id == "q":
            return 0, self.q_size, self.tp_rank, self.tp_size
        kv_rank, kv_ranks = self.tp_rank // self.num_kv_head_replicas, self.tp_size // self.num_kv_head_replicas
        if shard_id == "k":
            return self.q_size, self.kv_size, kv_rank, kv_ranks
        if shard_id == "v":
            return self.q_size + self.kv_size, self.kv_size, kv_rank, kv_ranks
        raise ValueError(f"{type(self).__name__} {self.prefix!r}: shard id {shard_id!r} is not one of {self.shard_ids}")


class RowParallelLinear(LinearBase):
    """Input features split over ranks: this rank multiplies its slice of the
    input by its columns of ``W``; the partial outputs are summed over ranks and
    the bias is added once, after the sum."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__(
            input_size, output_size, prefix=prefix, params_dtype=params_dtype, tp_rank=tp_rank, tp_size=tp_size
        )
        self.input_size_per_partition = divide(
            input_size, self.tp_size, f"{prefix or 'a row-parallel layer'}: input size {input_size}"
        )
        self.output_partition_sizes = [output_size]
        self._create_weights(quant_config, output_size if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out]
        bound = self._bound
        if bound is not None:
            return bound(x)
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        out = all_reduce(self.quant_method.apply(self, x, None), self.tp_size)
        return out if self.bias is None else out + self.bias

    def bind_forward(self, enabled: bool = True) -> None:
        if self.tp_size == 1 or not enabled:
            super().bind_forward(enabled)
            return
        product, bias, tp_size = bound_apply(self.quant_method, self, None), self.bias, self.tp_size
        if product is None:
            self._bound = None
            return

        def reduced(x: torch.Tensor) -> torch.Tensor:  # the partial sums of every rank, then the bias once
            out = all_reduce(product(x), tp_size)
            return out if bias is None else out + bias

        self._bound = reduced

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None) -> None:
        _refuse_shard_id(self, shard_id)
        dim = getattr(param, "input_dim", None)
        if dim is not None:
            length = param.shape[dim]
            if loaded_weight.shape[dim] != length * self.tp_size:
                raise ModelLoadError(_shape_message(loaded_weight, dim, length * self.tp_size))
            loaded_weight = loaded_weight.narrow(dim, self.tp_rank * length, length)
        _copy(param.data, loaded_weight)


def _refuse_shard_id(layer: LinearBase, shard_id: ShardId | None) -> None:
    if shard_id is not None:
        raise ValueError(f"{type(layer).__name__} {layer.prefix!r} has no fused shards; got shard id {shard_id!r}")


def _scaled(features: int, extent: int, total_features: int) -> int:
    """``features`` of a layer whose ``total_features`` a parameter stores in
    ``extent`` entries (fewer when packed), in entries."""
    entries, remainder = divmod(features * extent, total_features)
    if remainder:
        raise ValueError(
            f"a parameter of extent {extent} along its output_dim cannot hold a shard of {features} "
            f"of {total_features} output features evenly; its extent must be proportional"
        )
    return entries


def _shape_message(loaded: torch.Tensor, dim: int, expected: int) -> str:
    return f"has shape {tuple(loaded.shape)}, the model expects size {expected} along dimension {dim}"


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ModelLoadError(f"has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}")
    dst.copy_(src)
