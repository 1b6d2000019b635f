"""``LoRALinear``: a vframe linear layer plus the LoRA delta of each adapter segment of the step.

The wrapper calls its base layer unchanged (any quantization method included)
and then, for each output slice, adds ``scaling * B (A x)`` to the rows of the
tokens whose request runs an adapter (``vframe.lora.ops``)::

    QKVParallelLinear            y = [ q | k | v ]    slices q_proj, k_proj, v_proj
    MergedColumnParallelLinear   y = [ gate | up ]    slices gate_proj, up_proj
    Column / Row / Replicated    y = [ out ]          one slice

Each slice has its own stack of ``max_loras`` slots, zero where unused::

    lora_a_{i}   [max_loras, max_rank, in / tp]     (row-parallel: A cut along in)
    lora_b_{i}   [max_loras, out_i / tp, max_rank]  (column-parallel: B cut along out)
    scaling      [num_slices, max_loras] float32

They are non-persistent buffers, so nothing that walks a model's parameters or
its ``state_dict`` takes them for weights. Which tokens use which slot comes
from a ``LoRAStepContext`` that the ``LoRAManager`` shares with all its layers
and sets before each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from vframe.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from vframe.layers.parallel import all_reduce
from vframe.lora.ops import LoRAKernel, LoRASegments
from vframe.lora.peft import LoRAWeights


@dataclass
class LoRAStepContext:
    """What the LoRA layers of one model read each step; the manager sets it.

    Attributes:
        segments: which tokens of the step use which adapter slot (none: no LoRA this step).
    """

    segments: LoRASegments


class LoRALinear(nn.Module):
    """``base_layer(x)`` plus, per output slice, the step's LoRA deltas."""

    def __init__(
        self,
        base_layer: LinearBase,
        context: LoRAStepContext,
        *,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kernel: LoRAKernel,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.context = context
        self.kernel = kernel
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.output_slices = list(base_layer.output_partition_sizes)  # this rank's features of each slice
        in_features = base_layer.input_size_per_partition
        for i, out_features in enumerate(self.output_slices):
            a = torch.zeros(max_loras, max_lora_rank, in_features, dtype=dtype, device=device)  # [L, R, in]
            b = torch.zeros(max_loras, out_features, max_lora_rank, dtype=dtype, device=device)  # [L, out_i, R]
            self.register_buffer(f"lora_a_{i}", a, persistent=False)
            self.register_buffer(f"lora_b_{i}", b, persistent=False)
        scaling = torch.zeros(len(self.output_slices), max_loras, dtype=torch.float32, device=device)  # [S, L]
        self.register_buffer("scaling", scaling, persistent=False)

    @property
    def num_slices(self) -> int:
        return len(self.output_slices)

    def lora_a(self, i: int) -> torch.Tensor:  # [L, R, in / tp]
        return getattr(self, f"lora_a_{i}")

    def lora_b(self, i: int) -> torch.Tensor:  # [L, out_i / tp, R]
        return getattr(self, f"lora_b_{i}")

    # ------------------------------------------------------------------ #
    # Tensor parallelism: the whole adapter in, this rank's shard out
    # ------------------------------------------------------------------ #

    def full_shapes(self, i: int, rank: int) -> tuple[list[int], list[int]]:
        """The shapes of slice ``i``'s unsharded ``A`` and ``B`` at ``rank``, as a PEFT file holds them."""
        base = self.base_layer
        if isinstance(base, ColumnParallelLinear):
            _, size, _, num_src = base._shard_layout(self._shard_id(i))
            return [rank, base.input_size], [size * num_src, rank]
        return [rank, base.input_size], [base.output_size, rank]

    def shard(self, i: int, weights: LoRAWeights) -> LoRAWeights:
        """This rank's part of slice ``i``'s adapter (shapes as ``full_shapes``): a column-parallel
        layer keeps its rows of ``B`` (as its weight loader keeps rows of ``W``), a row-parallel one
        its columns of ``A``."""
        base = self.base_layer
        lora_a, lora_b = weights.lora_a, weights.lora_b
        if isinstance(base, ColumnParallelLinear):
            _, size, src_index, _ = base._shard_layout(self._shard_id(i))
            lora_b = lora_b.narrow(0, src_index * size, size)
        elif isinstance(base, RowParallelLinear):
            size = base.input_size_per_partition
            lora_a = lora_a.narrow(1, base.tp_rank * size, size)
        return LoRAWeights(lora_a, lora_b, weights.scaling)

    def _shard_id(self, i: int) -> int | str | None:
        return self.base_layer.shard_ids[i] if self.base_layer.shard_ids else None

    # ------------------------------------------------------------------ #
    # Slots
    # ------------------------------------------------------------------ #

    def set_slot(self, slot: int, weights: Sequence[LoRAWeights | None]) -> None:
        """Put one adapter's sharded weights (one entry per slice; None: the slice is not
        adapted) in ``slot``, zero-padded to ``max_lora_rank``."""
        assert len(weights) == self.num_slices, (len(weights), self.num_slices)
        for i, w in enumerate(weights):
            a, b = self.lora_a(i)[slot], self.lora_b(i)[slot]  # [R, in], [out_i, R]
            a.zero_()
            b.zero_()
            if w is None:
                self.scaling[i, slot] = 0.0
                continue
            assert w.rank <= self.max_lora_rank, (w.rank, self.max_lora_rank)
            a[: w.rank].copy_(w.lora_a, non_blocking=True)
            b[:, : w.rank].copy_(w.lora_b, non_blocking=True)
            self.scaling[i, slot] = w.scaling

    def clear_slot(self, slot: int) -> None:
        self.set_slot(slot, [None] * self.num_slices)

    # ------------------------------------------------------------------ #
    # Forward
    # ------------------------------------------------------------------ #

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> as the base layer
        y = self.base_layer(x)
        segments = self.context.segments
        if segments.num_segments == 0:
            return y
        x2 = x.reshape(-1, x.shape[-1])  # [T, in / tp]
        if isinstance(self.base_layer, RowParallelLinear) and self.base_layer.tp_size > 1:
            # y is already summed over ranks; each rank's B (A_r x_r) is one term of the delta.
            delta = torch.zeros_like(y).view(-1, y.shape[-1])  # [T, out]
            self._add_deltas(delta, x2, segments)
            y += all_reduce(delta, self.base_layer.tp_size).view_as(y)
        else:
            self._add_deltas(y.view(-1, y.shape[-1]), x2, segments)
        return y

    def _add_deltas(self, y: torch.Tensor, x: torch.Tensor, segments: LoRASegments) -> None:
        start = 0
        for i, size in enumerate(self.output_slices):
            self.kernel(y[:, start : start + size], x, self.lora_a(i), self.lora_b(i), self.scaling[i], segments)
            start += size

    def extra_repr(self) -> str:
        return f"slices={self.output_slices}, max_loras={self.max_loras}, max_lora_rank={self.max_lora_rank}"
