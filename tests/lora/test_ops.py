"""vframe.lora.ops: segments and the built-in torch LoRA kernel."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vframe.lora import LoRASegments, add_lora
from vframe.testing.lora import reference_add_lora

# Two adapters zero-padded to rank 2: slot 0 has rank 1, slot 1 rank 2.
LORA_A = torch.tensor(
    [
        [[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]],  # slot 0: A [1, 3], padded row
        [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]],  # slot 1: A [2, 3]
    ]
)  # [L=2, R=2, in=3]
LORA_B = torch.tensor(
    [
        [[1.0, 0.0], [2.0, 0.0]],  # slot 0: B [2, 1], padded column
        [[1.0, 1.0], [0.0, -1.0]],  # slot 1: B [2, 2]
    ]
)  # [L=2, out=2, R=2]
SCALING = torch.tensor([0.5, 2.0])
X = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 1.0], [2.0, 0.0, 1.0], [0.0, 1.0, 1.0]])  # [T=5, in=3]


def y0() -> torch.Tensor:
    return torch.tensor([[10.0, 20.0], [30.0, 40.0], [50.0, 60.0], [70.0, 80.0], [90.0, 100.0]])  # [T=5, out=2]


def test_add_lora_hand_computed() -> None:
    # tokens 0-1 use slot 1, token 2 no adapter, tokens 3-4 slot 0
    segments = LoRASegments.from_lists([0, 3], [2, 5], [1, 0])
    y = y0()
    add_lora(y, X, LORA_A, LORA_B, SCALING, segments)
    # token 0: A1 x = [1, 0], B1 [1, 0] = [1, 0], x2 -> [2, 0]
    # token 1: A1 x = [0, 1], B1 [0, 1] = [1, -1], x2 -> [2, -2]
    # token 3: A0 x = [2, 0], B0 [2, 0] = [2, 4], x0.5 -> [1, 2]
    # token 4: A0 x = [2, 0] -> [1, 2]
    expected = torch.tensor([[12.0, 20.0], [32.0, 38.0], [50.0, 60.0], [71.0, 82.0], [91.0, 102.0]])
    assert torch.equal(y, expected)


def test_adjacent_segments_of_one_slot_add_as_one_segment() -> None:
    y_a, y_b = y0(), y0()
    add_lora(y_a, X, LORA_A, LORA_B, SCALING, LoRASegments.from_lists([0, 2], [2, 5], [1, 0]))
    add_lora(y_b, X, LORA_A, LORA_B, SCALING, LoRASegments.from_lists([0, 2, 4], [2, 4, 5], [1, 0, 0]))
    # token 2 now uses slot 0: A0 x = [3, 0], B0 [3, 0] = [3, 6], x0.5 -> [1.5, 3]
    expected = torch.tensor([[12.0, 20.0], [32.0, 38.0], [51.5, 63.0], [71.0, 82.0], [91.0, 102.0]])
    assert torch.equal(y_a, expected)
    assert torch.equal(y_b, expected)


def test_no_segments_leaves_y_unchanged() -> None:
    y = y0()
    add_lora(y, X, LORA_A, LORA_B, SCALING, LoRASegments.from_lists([], [], []))
    assert torch.equal(y, y0())


def test_matches_the_reference_on_a_random_step() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 16, generator=g)
    lora_a = torch.randn(3, 4, 16, generator=g)
    lora_b = torch.randn(3, 24, 4, generator=g)
    scaling = torch.tensor([0.5, 1.5, 3.0])
    y = torch.randn(40, 24, generator=g)
    segments = LoRASegments.from_lists([0, 7, 20, 21, 30], [5, 20, 21, 29, 40], [2, 0, 2, 1, 0])
    expected = reference_add_lora(y, x, lora_a, lora_b, scaling, segments)
    add_lora(y, x, lora_a, lora_b, scaling, segments)
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[5:7].double(), expected[5:7])  # tokens 5, 6: in no segment
    assert torch.equal(y[29].double(), expected[29])


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        if func in (aten.mm.default, aten.mm.out, aten.bmm.default, aten.addmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_one_shrink_and_one_expand_per_distinct_slot() -> None:
    x = torch.randn(300, 8)
    y = torch.zeros(300, 8)
    lora_a, lora_b = torch.randn(4, 2, 8), torch.randn(4, 8, 2)
    # 5 segments, 2 distinct slots of 200 and 100 tokens: too uneven to pad into one batch,
    # so one mm pair per slot: 4 matmuls, not one per token or per segment
    segments = LoRASegments.from_lists([0, 50, 100, 200, 250], [50, 100, 200, 250, 300], [3, 1, 3, 1, 3])
    with _CountMatmuls() as counter:
        add_lora(y, x, lora_a, lora_b, torch.ones(4), segments)
    assert counter.count == 4


def test_a_decode_step_is_one_batched_shrink_and_expand() -> None:
    x = torch.randn(64, 8)
    lora_a, lora_b = torch.randn(4, 2, 8), torch.randn(4, 8, 2)
    scaling = torch.tensor([0.5, 1.5, 3.0, 2.0])
    # 62 one-token requests round-robin over slots 2, 0, 3, 1 (16, 16, 15, 15 tokens), 2 without an adapter
    tokens = [t for t in range(64) if t not in (5, 40)]
    segments = LoRASegments.from_lists(tokens, [t + 1 for t in tokens], [(2, 0, 3, 1)[i % 4] for i in range(62)])
    y = torch.randn(64, 8)
    expected = reference_add_lora(y, x, lora_a, lora_b, scaling, segments)
    with _CountMatmuls() as counter:
        add_lora(y, x, lora_a, lora_b, scaling, segments)
    assert counter.count == 2
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[[5, 40]].double(), expected[[5, 40]])


def test_segment_fields() -> None:
    segments = LoRASegments.from_lists([0, 3], [2, 5], [1, 0])
    assert segments.starts.tolist() == [0, 3]
    assert segments.ends.tolist() == [2, 5]
    assert segments.slots.tolist() == [1, 0]
    assert segments.starts.dtype == torch.int64
    assert (segments.num_segments, segments.num_tokens) == (2, 4)


@pytest.mark.parametrize(
    ("starts", "ends", "slots", "message"),
    [
        ([0, 3], [2], [0, 1], "one entry per segment"),
        ([0, 1], [2, 4], [0, 1], r"segment 1 is tokens \[1, 4\) after a segment ending at 2"),
        ([3, 0], [5, 2], [0, 1], r"segment 1 is tokens \[0, 2\)"),
        ([2], [2], [0], r"segment 0 is tokens \[2, 2\)"),
        ([0], [2], [-1], "segment 0 has slot -1"),
    ],
)
def test_invalid_segments_are_refused(starts: list[int], ends: list[int], slots: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoRASegments.from_lists(starts, ends, slots)


def test_segments_past_the_step_or_the_stack_are_refused() -> None:
    with pytest.raises(ValueError, match="ends at token 6, past the step's 5"):
        add_lora(y0(), X, LORA_A, LORA_B, SCALING, LoRASegments.from_lists([0], [6], [0]))
    with pytest.raises(ValueError, match="slot 2 of a stack of 2 adapters"):
        add_lora(y0(), X, LORA_A, LORA_B, SCALING, LoRASegments.from_lists([0], [5], [2]))
