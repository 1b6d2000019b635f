"""The batched LoRA delta: which tokens use which adapter, and the kernel that adds it.

A step's tokens are flattened into one batch ``[T, ...]``; consecutive tokens
of one request share an adapter, so the step is described by segments
(half-open token ranges), each naming a slot of the stacked adapter weights::

    tokens   0  1  2  3  4  5  6  7  8
    segment [ slot 2 ]     [slot 0]  [1]      starts [0, 4, 8], ends [3, 7, 9], slots [2, 0, 1]
    token 3 is in no segment (a request without an adapter): its row of y is left as it is

Stacked weights hold every loaded adapter, zero-padded to the stack's largest
rank ``R``: an adapter of rank ``r < R`` has rows ``r:`` of its ``A`` and
columns ``r:`` of its ``B`` zero, so the padding adds exactly zero (and must
be zero, not uninitialized memory: ``0 * NaN`` is NaN)::

    lora_a   [L, R, in]     A of each slot
    lora_b   [L, out, R]    B of each slot
    scaling  [L] float32    alpha / r of each slot (or what the adapter's config says)

A kernel sees the shard of ``A`` and ``B`` that its layer's wrapper passes (for
a column-parallel layer ``B`` cut along ``out``, for a row-parallel one ``A``
cut along ``in``); the wrapper owns that split (DESIGN.md §9). ``y`` may be a
column slice of a fused output (one of ``[q | k | v]``), so rows of ``y`` can
be strided.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch


@dataclass(frozen=True, eq=False)
class LoRASegments:
    """Which tokens of the step's flattened batch use which adapter slot.

    Segments are sorted by ``starts``, non-overlapping and non-empty; two
    adjacent segments may name the same slot. Tokens in no segment get no
    delta. Build one with ``from_lists``.

    Attributes:
        starts: ``[S]`` int64, first token of each segment.
        ends: ``[S]`` int64, one past the last token of each segment.
        slots: ``[S]`` int64, index of each segment's adapter in the stacked weights.
        starts_cpu: host copy of ``starts``, for planning without a device sync.
        ends_cpu: host copy of ``ends``.
        slots_cpu: host copy of ``slots``.
    """

    starts: torch.Tensor
    ends: torch.Tensor
    slots: torch.Tensor
    starts_cpu: list[int]
    ends_cpu: list[int]
    slots_cpu: list[int]

    def __post_init__(self) -> None:
        num_segments = len(self.starts_cpu)
        if not len(self.ends_cpu) == len(self.slots_cpu) == num_segments:
            raise ValueError(
                f"LoRASegments: starts, ends and slots must have one entry per segment, got "
                f"{num_segments}, {len(self.ends_cpu)} and {len(self.slots_cpu)}"
            )
        previous_end = 0
        for i, (start, end, slot) in enumerate(zip(self.starts_cpu, self.ends_cpu, self.slots_cpu, strict=True)):
            if not previous_end <= start < end:
                raise ValueError(
                    f"LoRASegments: segment {i} is tokens [{start}, {end}) after a segment ending at "
                    f"{previous_end}; segments must be non-empty, sorted and non-overlapping"
                )
            if slot < 0:
                raise ValueError(f"LoRASegments: segment {i} has slot {slot}; slots index the stacked adapters")
            previous_end = end
        for name in ("starts", "ends", "slots"):
            tensor = getattr(self, name)
            assert tensor.dtype == torch.int64 and tuple(tensor.shape) == (num_segments,), (name, tensor)

    @classmethod
    def from_lists(
        cls,
        starts: Sequence[int],
        ends: Sequence[int],
        slots: Sequence[int],
        *,
        device: torch.device | str = "cpu",
    ) -> LoRASegments:
        def tensor(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(list(values), dtype=torch.int64).to(device, non_blocking=True)  # [S]

        return cls(tensor(starts), tensor(ends), tensor(slots), list(starts), list(ends), list(slots))

    @property
    def num_segments(self) -> int:
        return len(self.starts_cpu)

    @property
    def num_tokens(self) -> int:
        """Tokens in some segment."""
        return sum(end - start for start, end in zip(self.starts_cpu, self.ends_cpu, strict=True))

    @cached_property
    def by_slot(self) -> SlotGroups:
        """The step's tokens grouped by slot, built on first use and shared by every layer of the step."""
        return SlotGroups.build(self)


# A padded batch may hold at most this many rows per token in a segment; beyond it
# (one long prompt beside short ones) the kernel loops over slots instead.
_MAX_PADDING = 1.25


@dataclass(frozen=True, eq=False)
class SlotGroups:
    """The tokens of a step's segments sorted by slot, for a kernel that gathers them once::

        segments  [0, 2) slot 1, [2, 3) slot 0, [3, 4) slot 1, [5, 6) slot 0
        slots_cpu [1, 0]             distinct slots, in order of first use
        token_ids [0, 1, 3, 2, 5]    slot 1's tokens, then slot 0's
        bounds    [(0, 3), (3, 5)]   each slot's rows of token_ids
        padded    [0, 1, 3, 2, 5, 2] [U * M] token_ids with each slot's rows padded to M = 3
        rows      [0, 1, 2, 3, 4]    rows of padded that hold token_ids (None: no padding)

    Attributes:
        slots: ``[U]`` int64, the distinct slots.
        slots_cpu: host copy of ``slots``.
        token_ids: ``[n]`` int64, the tokens in some segment, grouped by slot.
        bounds: ``(first, end)`` rows of ``token_ids`` of each slot.
        padded: ``[U * M]`` int64, ``token_ids`` with each slot's group padded to the largest
            (``M`` rows) by repeating its own first token; None when padding would cost more than
            ``_MAX_PADDING`` times the tokens.
        rows: ``[n]`` int64, the rows of ``padded`` that are not padding; None when none are.
    """

    slots: torch.Tensor
    slots_cpu: list[int]
    token_ids: torch.Tensor
    bounds: list[tuple[int, int]]
    padded: torch.Tensor | None
    rows: torch.Tensor | None

    @property
    def max_count(self) -> int:
        return max(end - first for first, end in self.bounds)

    @classmethod
    def build(cls, segments: LoRASegments) -> SlotGroups:
        device = segments.starts.device
        ranges_by_slot: dict[int, list[range]] = {}
        for start, end, slot in zip(segments.starts_cpu, segments.ends_cpu, segments.slots_cpu, strict=True):
            ranges_by_slot.setdefault(slot, []).append(range(start, end))
        groups = [[t for r in ranges for t in r] for ranges in ranges_by_slot.values()]
        token_ids = [t for group in groups for t in group]
        bounds, first = [], 0
        for group in groups:
            bounds.append((first, first + len(group)))
            first += len(group)
        max_count = max(len(group) for group in groups)
        padded = rows = None
        if len(groups) * max_count <= _MAX_PADDING * len(token_ids):
            padded_ids = [t for group in groups for t in group + [group[0]] * (max_count - len(group))]
            if len(padded_ids) > len(token_ids):
                rows_cpu = [i * max_count + j for i, group in enumerate(groups) for j in range(len(group))]
                rows = torch.tensor(rows_cpu, dtype=torch.int64).to(device, non_blocking=True)
            padded = torch.tensor(padded_ids, dtype=torch.int64).to(device, non_blocking=True)
        slots_cpu = list(ranges_by_slot)
        return cls(
            slots=torch.tensor(slots_cpu, dtype=torch.int64).to(device, non_blocking=True),
            slots_cpu=slots_cpu,
            token_ids=torch.tensor(token_ids, dtype=torch.int64).to(device, non_blocking=True),
            bounds=bounds,
            padded=padded,
            rows=rows,
        )


class LoRAKernel(Protocol):
    """What a LoRA kernel computes, in place: for every token ``t`` in a segment with slot ``s``,
    ``y[t] += scaling[s] * (lora_b[s] @ (lora_a[s] @ x[t]))``; every other row of ``y``
    stays bit-for-bit as it was. ``add_lora`` is the built-in one;
    ``vframe.testing.check_lora_kernel`` checks any other."""

    def __call__(
        self,
        y: torch.Tensor,  # [T, out]
        x: torch.Tensor,  # [T, in]
        lora_a: torch.Tensor,  # [L, R, in]
        lora_b: torch.Tensor,  # [L, out, R]
        scaling: torch.Tensor,  # [L] float32
        segments: LoRASegments,
    ) -> None: ...


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    segments: LoRASegments,
) -> None:
    """Add each segment's low-rank delta to ``y`` in place (see ``LoRAKernel``).

    The step's tokens are gathered once, grouped by slot (``segments.by_slot``).
    When the groups are of similar sizes (a decode step: one token per request)
    they are padded to one batch and the shrink (``x A^T``) and the expand
    (``B``) are one ``bmm`` each over the distinct slots; otherwise one ``mm``
    each per distinct slot. In ``x``'s dtype, float32 accumulation where torch's
    matmul does it. Slots no segment names are never read."""
    if segments.num_segments == 0:
        return
    num_tokens = x.shape[0]
    if segments.ends_cpu[-1] > num_tokens:
        raise ValueError(f"add_lora: a segment ends at token {segments.ends_cpu[-1]}, past the step's {num_tokens}")
    if max(segments.slots_cpu) >= lora_a.shape[0]:
        raise ValueError(f"add_lora: slot {max(segments.slots_cpu)} of a stack of {lora_a.shape[0]} adapters")

    groups = segments.by_slot
    dtype = x.dtype
    if groups.padded is not None:
        num_slots, max_count = len(groups.slots_cpu), groups.max_count
        if groups.slots_cpu == list(range(lora_a.shape[0])):
            a, b, s = lora_a, lora_b, scaling  # every slot, in order: no gather
        else:
            a, b, s = (w.index_select(0, groups.slots) for w in (lora_a, lora_b, scaling))
        xs = x.index_select(0, groups.padded).view(num_slots, max_count, -1)  # [U, M, in]
        shrunk = torch.bmm(xs, a.to(dtype).transpose(1, 2))  # [U, M, R]
        shrunk *= s.to(dtype).view(num_slots, 1, 1)
        delta = torch.bmm(shrunk, b.to(dtype).transpose(1, 2)).view(num_slots * max_count, -1)  # [U * M, out]
        if groups.rows is not None:
            delta = delta.index_select(0, groups.rows)  # [n, out]
    else:
        xs = x.index_select(0, groups.token_ids)  # [n, in]
        delta = torch.empty(xs.shape[0], y.shape[1], dtype=dtype, device=x.device)  # [n, out]
        for slot, (first, end) in zip(groups.slots_cpu, groups.bounds, strict=True):
            shrunk = (xs[first:end] @ lora_a[slot].to(dtype).T) * scaling[slot]  # [m, R]; 0-d scaling keeps dtype
            torch.mm(shrunk, lora_b[slot].to(dtype).T, out=delta[first:end])  # [m, out]
    # each token is in one segment: a gather, an add and a copy back (index_add_ is slower on the CPU)
    y.index_copy_(0, groups.token_ids, y.index_select(0, groups.token_ids) + delta.to(y.dtype))
