"""vframe.testing.lora: passes the built-in kernel and catches the mistakes a kernel author makes."""

from __future__ import annotations

import pytest
import torch

from vframe.lora import LoRASegments, add_lora
from vframe.testing import check_lora_kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_built_in_kernel_passes(dtype: torch.dtype) -> None:
    check_lora_kernel(add_lora, dtype=dtype)


def test_quick_form_passes_float16() -> None:
    check_lora_kernel(dtype=torch.float16, quick=True)


def _deltas(x, lora_a, lora_b, scaling, segments, slot_of=lambda slot: slot):
    """(token ids [n], delta [n, out]) of each segment, computed segment by segment."""
    for start, end, slot in zip(segments.starts_cpu, segments.ends_cpu, segments.slots_cpu, strict=True):
        s = slot_of(slot)
        yield torch.arange(start, end), scaling[s] * (x[start:end] @ lora_a[s].T @ lora_b[s].T)


def overwrites_y(y, x, lora_a, lora_b, scaling, segments) -> None:
    for tokens, delta in _deltas(x, lora_a, lora_b, scaling, segments):
        y[tokens] = delta.to(y.dtype)


def ignores_scaling(y, x, lora_a, lora_b, scaling, segments) -> None:
    add_lora(y, x, lora_a, lora_b, torch.ones_like(scaling), segments)


def uses_slot_0(y, x, lora_a, lora_b, scaling, segments) -> None:
    for tokens, delta in _deltas(x, lora_a, lora_b, scaling, segments, slot_of=lambda slot: 0):
        y[tokens] += delta.to(y.dtype)


def reads_starts_only(y, x, lora_a, lora_b, scaling, segments) -> None:
    """Takes each segment to run up to the next one's start: writes into the gaps."""
    ends = [*segments.starts_cpu[1:], segments.ends_cpu[-1]] if segments.num_segments else []
    grown = LoRASegments.from_lists(segments.starts_cpu, ends, segments.slots_cpu, device=y.device)
    add_lora(y, x, lora_a, lora_b, scaling, grown)


def masks_every_slot(y, x, lora_a, lora_b, scaling, segments) -> None:
    """Computes every slot for every token and keeps one by a 0/1 mask: 0 * NaN is NaN."""
    num_slots = lora_a.shape[0]
    one_hot = torch.zeros(x.shape[0], num_slots, dtype=x.dtype)  # [T, L]
    for start, end, slot in zip(segments.starts_cpu, segments.ends_cpu, segments.slots_cpu, strict=True):
        one_hot[start:end, slot] = 1
    every = torch.einsum("ti,lri,lor,l->tlo", x, lora_a, lora_b, scaling.to(x.dtype))  # [T, L, out]
    covered = one_hot.sum(dim=1) > 0
    y[covered] += torch.einsum("tlo,tl->to", every, one_hot)[covered]


def writes_strided_y_as_contiguous(y, x, lora_a, lora_b, scaling, segments) -> None:
    """Adds into a contiguous copy of y and writes it back through the underlying storage, as a
    kernel that ignores y's row stride would."""
    result = y.clone()
    add_lora(result, x, lora_a, lora_b, scaling, segments)
    y.as_strided((y.numel(),), (1,)).copy_(result.flatten())


@pytest.mark.parametrize(
    ("kernel", "message"),
    [
        (overwrites_y, r"one adapter on every token \(torch.float32, 6 tokens\): y\[\d+, \d+\] is .*, the reference"),
        (ignores_scaling, r"one adapter on every token .* off by"),
        (uses_slot_0, r"adapters of ranks 1, 3 and 8, segments skipping tokens, slots out of order .* off by"),
        (reads_starts_only, r"segments skipping tokens, .*: tokens \[4, 5, 12, 13\] are in no segment"),
        (masks_every_slot, r"NaN in the weights of unused slots 1 and 3 .*: y holds NaN"),
        (writes_strided_y_as_contiguous, r"y a column slice of a wider output .*: tokens \[3\] are in no segment"),
    ],
)
def test_broken_kernels_fail(kernel, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_lora_kernel(kernel, quick=True)


def test_bfloat16_check_catches_a_missing_scaling() -> None:
    with pytest.raises(AssertionError, match="one adapter on every token"):
        check_lora_kernel(ignores_scaling, dtype=torch.bfloat16, quick=True)
