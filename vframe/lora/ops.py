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

    Tokens are gathered by slot, then one shrink (``x A^T``) and one expand
    (``B``) matmul run per distinct slot of the step, in ``x``'s dtype
    (float32 accumulation where torch's matmul does it). Slots no segment
    names are never read."""
    if segments.num_segments == 0:
        return
    num_tokens = x.shape[0]
    if segments.ends_cpu[-1] > num_tokens:
        raise ValueError(f"add_lora: a segment ends at token {segments.ends_cpu[-1]}, past the step's {num_tokens}")
    if max(segments.slots_cpu) >= lora_a.shape[0]:
        raise ValueError(f"add_lora: slot {max(segments.slots_cpu)} of a stack of {lora_a.shape[0]} adapters")

    ranges_by_slot: dict[int, list[torch.Tensor]] = {}
    for start, end, slot in zip(segments.starts_cpu, segments.ends_cpu, segments.slots_cpu, strict=True):
        ranges_by_slot.setdefault(slot, []).append(torch.arange(start, end))
    for slot, ranges in ranges_by_slot.items():
        token_ids = torch.cat(ranges).to(y.device, non_blocking=True)  # [n]
        xs = x.index_select(0, token_ids)  # [n, in]
        shrunk = (xs @ lora_a[slot].to(x.dtype).T) * scaling[slot]  # [n, R]; scaling is 0-d: keeps x's dtype
        delta = shrunk @ lora_b[slot].to(x.dtype).T  # [n, out]
        y.index_add_(0, token_ids, delta.to(y.dtype))
