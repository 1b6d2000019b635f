"""Conformance checks for LoRA kernels: ``check_lora_kernel``.

A LoRA kernel (``vframe.lora.LoRAKernel``) adds, in place, for every token
``t`` in a segment with slot ``s``: ``y[t] += scaling[s] * (lora_b[s] @
(lora_a[s] @ x[t]))``. The check runs the kernel on small steps built to catch
the usual mistakes and compares ``y`` with ``reference_add_lora``, a per-token
float64 loop over the very ``dtype``-rounded inputs the kernel gets.

What "correct" means
--------------------
* **It adds.** ``y`` is prefilled with random values; the kernel must add the
  delta to them, not overwrite them.
* **Tokens in no segment are untouched, bit for bit**, and so are the columns
  of a wider output around a ``y`` that is a column slice of it (one of a fused
  ``[q | k | v]``). ``x``, the weights and ``scaling`` are not modified.
* **Unused slots are never read.** The weights of slots no segment names are
  NaN in one case; a kernel that computes every slot and masks the result
  (``0 * NaN`` is NaN) fails it.
* **Agreement within tolerance** for tokens in a segment: every element of
  token ``t``'s row is within ``LORA_TOLERANCES[dtype] * m[t]`` of the
  reference, ``m[t]`` being the row's magnitude (its largest ``|y|`` before
  the kernel or in the reference). Relative to the row, not to each element:
  ``y + delta`` of O(1) terms can cancel to near zero.

The cases: several adapters of different ranks zero-padded to the stack's
largest, segments that skip tokens, adjacent segments of one slot, one-token
segments (a decode step), slots out of order, a step where no token uses an
adapter, an empty step (``T = 0``) and a strided ``y``; ``quick=False`` adds
larger steps with random segments.

Tolerances (``LORA_TOLERANCES``): float32 kernels differ from the reference
only by summation order (~2e-6 of the row here); float16 keeps 11
significant bits and bfloat16 8, so rounding ``y + delta`` alone costs up to
``2**-12`` and ``2**-9`` of the row's magnitude, and rounding the ``[n, R]``
shrink result and the delta to the dtype before adding costs about as much
again each. The built-in ``add_lora`` on the CPU reaches 1.4e-3 (float16) and
1.2e-2 (bfloat16) of the row; the tolerances leave 2.5x or more on top, and a
kernel that keeps the shrink result in float32 does better. Inputs are scaled
so that ``y`` and the delta are O(1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vframe.lora.ops import LoRAKernel, LoRASegments, add_lora

LORA_TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
}
"""``dtype -> tolerance`` for ``check_lora_kernel``: the largest error allowed,
as a fraction of the token's row magnitude, against the float64 reference
computed from the same ``dtype``-rounded inputs."""
_SCALINGS = (0.5, 2.0, 0.25, 1.75)  # scaling of slot i: _SCALINGS[i % 4], none near 1


@dataclass(frozen=True)
class _Case:
    name: str
    num_tokens: int
    ranks: tuple[int, ...]  # effective rank of each slot; the stack is zero-padded to the largest
    segments: tuple[tuple[int, int, int], ...]  # (start, end, slot)
    in_features: int = 64
    out_features: int = 96
    nan_slots: tuple[int, ...] = ()  # slots no segment names, their weights all NaN
    strided_y: bool = False  # y is a column slice of a wider output


_QUICK = [
    _Case("one adapter on every token", 6, (4,), ((0, 6, 0),)),
    _Case(
        "adapters of ranks 1, 3 and 8, segments skipping tokens, slots out of order",
        20,
        (1, 3, 8),
        ((1, 4, 2), (6, 11, 0), (11, 12, 1), (14, 19, 2)),
    ),
    _Case("adjacent segments with the same slot", 10, (2, 4), ((0, 3, 1), (3, 7, 1), (7, 10, 0))),
    _Case(
        "one-token segments (a decode step)",
        8,
        (4, 2, 4),
        ((0, 1, 2), (1, 2, 0), (2, 3, 2), (3, 4, 1), (5, 6, 0), (7, 8, 1)),
    ),
    _Case("NaN in the weights of unused slots 1 and 3", 9, (4, 4, 2, 4), ((0, 4, 2), (4, 9, 0)), nan_slots=(1, 3)),
    _Case("no token uses an adapter", 5, (4,), ()),
    _Case("empty step (no tokens)", 0, (4,), ()),
    _Case("y a column slice of a wider output", 7, (4, 2), ((0, 3, 1), (4, 7, 0)), strided_y=True),
]


def reference_add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    segments: LoRASegments,
) -> torch.Tensor:
    """``y`` plus every segment's LoRA delta, token by token in float64 on the CPU.

    Takes a kernel's arguments; returns a new ``[T, out]`` float64 tensor and
    leaves ``y`` as it is."""
    out = y.detach().to("cpu", torch.float64, copy=True)  # [T, out]
    x64 = x.detach().to("cpu", torch.float64)
    for start, end, slot in zip(segments.starts_cpu, segments.ends_cpu, segments.slots_cpu, strict=True):
        a = lora_a[slot].detach().to("cpu", torch.float64)  # [R, in]
        b = lora_b[slot].detach().to("cpu", torch.float64)  # [out, R]
        scale = float(scaling[slot])
        for t in range(start, end):
            out[t] += scale * (b @ (a @ x64[t]))
    return out


def check_lora_kernel(
    kernel: LoRAKernel = add_lora,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    quick: bool = False,
) -> None:
    """Check a LoRA kernel against ``reference_add_lora``; raises ``AssertionError``.

    ``dtype``: of ``x``, ``y`` and the adapter weights (``scaling`` is always
    float32); ``device``: where every tensor lives (``"cuda"`` for a GPU
    kernel). See the module docstring for what is checked."""
    assert dtype in LORA_TOLERANCES, f"no LoRA tolerance for {dtype}; one of {list(LORA_TOLERANCES)}"
    generator = torch.Generator().manual_seed(0)
    cases = list(_QUICK)
    if not quick:
        cases += [_random_case(f"random step {i}", generator) for i in range(3)]
    for case in cases:
        _check_case(kernel, case, dtype, torch.device(device), generator)


def _random_case(name: str, generator: torch.Generator) -> _Case:
    """A larger step: random segment lengths, gaps and slots; the last slot unused and NaN."""

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high, (), generator=generator))

    ranks = (8, 16, 4, 16, 1, 12)
    segments = []
    token = 0
    while len(segments) < 24:
        token += randint(0, 3) if randint(0, 2) else 0  # a gap before half the segments
        length = randint(1, 41)
        segments.append((token, token + length, randint(0, len(ranks) - 1)))
        token += length
    return _Case(name, token + randint(0, 3), ranks, tuple(segments), 256, 384, nan_slots=(len(ranks) - 1,))


def _check_case(
    kernel: LoRAKernel, case: _Case, dtype: torch.dtype, device: torch.device, generator: torch.Generator
) -> None:
    where = f"{case.name} ({dtype}, {case.num_tokens} tokens)"
    num_slots, max_rank = len(case.ranks), max(case.ranks)
    hidden_in, hidden_out = case.in_features, case.out_features

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    x = randn(case.num_tokens, hidden_in)  # [T, in]
    lora_a = randn(num_slots, max_rank, hidden_in) / hidden_in**0.5  # [L, R, in]: shrink outputs O(1)
    lora_b = torch.zeros(num_slots, hidden_out, max_rank)  # [L, out, R]
    for slot, rank in enumerate(case.ranks):
        lora_a[slot, rank:] = 0
        lora_b[slot, :, :rank] = randn(hidden_out, rank) / rank**0.5
    for slot in case.nan_slots:
        lora_a[slot] = float("nan")
        lora_b[slot] = float("nan")
    scaling = torch.tensor([_SCALINGS[slot % len(_SCALINGS)] for slot in range(num_slots)])  # [L] float32
    pad = 5 if case.strided_y else 0
    y_full = randn(case.num_tokens, pad + hidden_out + pad)  # [T, out + 2 pad]

    x, lora_a, lora_b, y_full = (t.to(device, dtype) for t in (x, lora_a, lora_b, y_full))
    scaling = scaling.to(device)
    y = y_full[:, pad : pad + hidden_out]  # [T, out]
    starts, ends, slots = zip(*case.segments, strict=True) if case.segments else ((), (), ())
    segments = LoRASegments.from_lists(starts, ends, slots, device=device)
    inputs = {"x": x, "lora_a": lora_a, "lora_b": lora_b, "scaling": scaling}
    before = {name: t.clone() for name, t in inputs.items()}
    y_full_before = y_full.clone()
    expected = reference_add_lora(y, x, lora_a, lora_b, scaling, segments)  # [T, out] float64

    with torch.inference_mode():
        kernel(y, x, lora_a, lora_b, scaling, segments)

    for name, tensor in inputs.items():
        assert _same(tensor, before[name]), f"{where}: the kernel modified {name}"
    covered = torch.zeros(case.num_tokens, dtype=torch.bool)  # [T]
    for start, end, _ in case.segments:
        covered[start:end] = True
    y_after, y_full_after, y_full_before = y.cpu(), y_full.cpu(), y_full_before.cpu()
    outside = (~covered).nonzero().flatten().tolist()
    changed = [t for t in outside if not torch.equal(y_full_after[t], y_full_before[t])]
    assert not changed, f"{where}: tokens {changed} are in no segment, but the kernel changed their rows of y"
    if pad:
        assert torch.equal(y_full_after[:, :pad], y_full_before[:, :pad]) and torch.equal(
            y_full_after[:, pad + hidden_out :], y_full_before[:, pad + hidden_out :]
        ), f"{where}: the kernel wrote outside y's columns of the wider output it is a slice of"
    if not covered.any():
        return

    tolerance = LORA_TOLERANCES[dtype]
    got, ref = y_after[covered].double(), expected[covered]  # [n, out]
    assert bool(torch.isfinite(got).all()), (
        f"{where}: y holds NaN or inf after the kernel; "
        f"the weights of unused slots {list(case.nan_slots)} are NaN and must not be read"
    )
    magnitude = torch.maximum(y_full_before[covered, pad : pad + hidden_out].double().abs(), ref.abs())
    magnitude = magnitude.amax(dim=1, keepdim=True).clamp(min=1e-30)  # [n, 1]
    relative = (got - ref).abs() / magnitude  # [n, out]
    if not bool((relative <= tolerance).all()):
        row, col = divmod(int(relative.argmax()), hidden_out)
        token = int(covered.nonzero().flatten()[row])
        raise AssertionError(
            f"{where}: y[{token}, {col}] is {float(got[row, col]):.6g}, the reference "
            f"y + scaling * B (A x) is {float(ref[row, col]):.6g}: off by {float(relative[row, col]):.3g} of the "
            f"row's magnitude {float(magnitude[row]):.3g} (allowed: {tolerance}); a kernel that overwrites y, "
            "skips scaling or reads the wrong slot's weights fails here"
        )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal elementwise, NaN matching NaN."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())
