"""vframe.testing.attention: the reference it holds backends to, and that it
catches the mistakes a backend author makes."""

from __future__ import annotations

import dataclasses
import math
import unittest

import pytest
import torch
import torch.nn.functional as F

from vframe.backends.torch_attn import (
    PrefillSpan,
    TorchAttentionBackend,
    TorchAttentionImpl,
    TorchAttentionMetadata,
)
from vframe.core.interfaces import AttentionImpl
from vframe.testing.attention import (
    ATTENTION_TOLERANCES,
    accepted_configurations,
    check_attention_backend,
    reference_attention,
)

# --------------------------------------------------------------------------- #
# The reference
# --------------------------------------------------------------------------- #


def test_reference_by_hand() -> None:
    # One head, D = 1, keys 0 and 1 with values 10 and 20. The second query
    # (position 1) scores 0 * 2 = 0 and 1 * 2 = 2: weights e^0 / (e^0 + e^2) and
    # e^2 / (e^0 + e^2); the first sees only key 0.
    query = torch.tensor([[[5.0]], [[2.0]]])  # [Q=2, H=1, D=1]
    key = torch.tensor([[[0.0]], [[1.0]]])  # [S=2, KVH=1, D=1]
    value = torch.tensor([[[10.0]], [[20.0]]])

    out = reference_attention(query, key, value, scale=1.0)

    second = (10 + 20 * math.e**2) / (1 + math.e**2)
    assert out.flatten().tolist() == pytest.approx([10.0, second], abs=1e-5)


def test_reference_window_gqa_and_cached_prefix() -> None:
    # 2 query heads share one KV head; the last query sees keys 2 and 3 only (window 2).
    query = torch.tensor([[[0.0], [0.0]]])  # [Q=1, H=2, D=1]: equal scores
    key = torch.zeros(4, 1, 1)
    value = torch.tensor([[[1.0]], [[2.0]], [[3.0]], [[5.0]]])

    out = reference_attention(query, key, value, scale=1.0, sliding_window=2)

    assert out.flatten().tolist() == [4.0, 4.0]  # (3 + 5) / 2 on both heads


def test_reference_equals_sdpa_for_a_prefill() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(11, h, 32, generator=gen) for h in (8, 2, 2))

    ours = reference_attention(q, k, v, scale=0.2)
    sdpa = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.2, enable_gqa=True
    ).transpose(0, 1)

    torch.testing.assert_close(ours, sdpa, rtol=0, atol=1e-6)


def test_tolerances_are_stated_for_every_dtype_backends_use() -> None:
    assert ATTENTION_TOLERANCES == {
        torch.float32: (1e-5, 1e-5),
        torch.float16: (5e-3, 5e-3),
        torch.bfloat16: (3e-2, 2e-2),
    }
    with pytest.raises(ValueError, match="no stated tolerance"):
        check_attention_backend("torch", dtype=torch.float64)


# --------------------------------------------------------------------------- #
# The built-in backend passes
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_backend_passes_quick_checks(dtype: torch.dtype) -> None:
    check_attention_backend("torch", dtype=dtype, quick=True)


def test_every_case_ends_by_reading_back_every_request() -> None:
    import vframe.testing.attention as kit

    # the last step decodes every request, so each token written earlier is read again
    assert all(case.steps[-1] == (1,) * len(case.steps[0]) for case in kit.CASES)
    assert len(kit.CASES) == 10 and {c.num_kv_heads == c.num_heads for c in kit.CASES} == {True, False}


def test_configurations_tried() -> None:
    configs, refusals = accepted_configurations(TorchAttentionBackend, torch.float32, torch.device("cpu"))
    assert configs == [(64, 16), (64, 4), (64, 32), (128, 16), (32, 16), (256, 16), (80, 16)]
    assert refusals == []
    quick, _ = accepted_configurations(TorchAttentionBackend, torch.float32, torch.device("cpu"), quick=True)
    assert quick == [(64, 16)]


# --------------------------------------------------------------------------- #
# Broken backends fail, each with a message that says what is wrong
# --------------------------------------------------------------------------- #


def _backend(name: str, impl: type[AttentionImpl], **extra: object) -> type[TorchAttentionBackend]:
    attrs: dict[str, object] = {"name": name, "get_impl_cls": staticmethod(lambda: impl), **extra}
    return type(f"Backend_{name}", (TorchAttentionBackend,), attrs)


def _plan(meta: object, sliding_window: int | None) -> TorchAttentionMetadata:
    common = meta if not isinstance(meta, TorchAttentionMetadata) else meta.common
    return TorchAttentionMetadata.from_common(common, sliding_window)


class IgnoresCachedPrefix(TorchAttentionImpl):
    """Attends only to this step's tokens of a prefill chunk."""

    def forward(self, query, key, value, kv_cache, attn_metadata):
        meta = _plan(attn_metadata, self.sliding_window)
        meta.prefills = [PrefillSpan(p.query_start, p.query_end, 0, None, None) for p in meta.prefills]
        return super().forward(query, key, value, kv_cache, meta)


class ReadsUnwrittenSlots(TorchAttentionImpl):
    """Gathers whole blocks and trusts the mask to hide what is past the end."""

    def forward(self, query, key, value, kv_cache, attn_metadata):
        meta = _plan(attn_metadata, self.sliding_window)
        meta.decode_groups = [
            dataclasses.replace(g, unwritten_rows=g.unwritten_rows[:0]) for g in meta.decode_groups
        ]
        return super().forward(query, key, value, kv_cache, meta)


class WrongGQAHeads(TorchAttentionImpl):
    """Query head h reads KV head h % KVH instead of h // (H // KVH)."""

    def forward(self, query, key, value, kv_cache, attn_metadata):
        group = self.num_heads // self.num_kv_heads
        order = torch.arange(self.num_heads).view(group, self.num_kv_heads).T.flatten()  # h % KVH first
        out = super().forward(query[:, order], key, value, kv_cache, attn_metadata)
        return out[:, torch.argsort(order)]


class WritesNeighbourSlot(TorchAttentionImpl):
    """Writes each token into the neighbouring slot of its block (slot ^ 1)."""

    def forward(self, query, key, value, kv_cache, attn_metadata):
        meta = _plan(attn_metadata, self.sliding_window)
        shifted = dataclasses.replace(meta.common, slot_mapping=meta.common.slot_mapping ^ 1)
        return super().forward(query, key, value, kv_cache, TorchAttentionMetadata.from_common(shifted))


class ReturnsFloat32(TorchAttentionImpl):
    def forward(self, query, key, value, kv_cache, attn_metadata):
        return super().forward(query, key, value, kv_cache, attn_metadata).float()


class NoSlidingWindow(TorchAttentionImpl):
    def __init__(self, *args, sliding_window=None, **kwargs) -> None:
        if sliding_window is not None:
            raise NotImplementedError("no sliding windows")
        super().__init__(*args, **kwargs)


def test_ignoring_the_cached_prefix_fails() -> None:
    with pytest.raises(
        AssertionError,
        match=r"case 'cached-prefix-gqa' \(torch.float32, .*\), step 1, layer 0: output differs from the "
        r"float32 reference: max \|out - ref\| = .* > atol \+ rtol \* \|ref\| = 1e-05 \+ 1e-05 \* ",
    ):
        check_attention_backend(_backend("ignores-prefix", IgnoresCachedPrefix), quick=True)


def test_reading_unwritten_slots_fails_in_every_dtype() -> None:
    # the original torch backend's decode path: NaN in the tail of the last block leaked
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(
            AssertionError,
            match=rf"case 'prefill-gqa' \({dtype}, .*step 0, layer 0: output has \d+ NaN/inf values, first at "
            r"token \d+ \(request \d of the step\): unused or padding KV slots leaked into the result",
        ):
            check_attention_backend(_backend("reads-unwritten", ReadsUnwrittenSlots), dtype=dtype, quick=True)


def test_wrong_gqa_head_mapping_fails_but_mha_cases_pass() -> None:
    broken = _backend("wrong-gqa", WrongGQAHeads)
    with pytest.raises(AssertionError, match=r"case 'prefill-gqa' .*H=8, KVH=2\), step 0, layer 0: output differs"):
        check_attention_backend(broken, quick=True)
    import vframe.testing.attention as kit

    only_mha = tuple(c for c in kit.CASES if c.num_kv_heads == c.num_heads)
    assert [c.name for c in only_mha] == ["prefill-mha", "mixed-mha"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kit, "CASES", only_mha)
        check_attention_backend(broken)  # H == KVH: the mapping does not matter


def test_writing_to_the_wrong_slot_fails() -> None:
    with pytest.raises(AssertionError, match=r"step 0, layer 0: the key of token 0 is not at its slot \d+"):
        check_attention_backend(_backend("writes-neighbour", WritesNeighbourSlot), quick=True)


def test_wrong_output_dtype_fails() -> None:
    with pytest.raises(
        AssertionError,
        match=r"forward returned \(57, 8, 64\) torch.float32 on cpu, expected \(57, 8, 64\) torch.bfloat16 on cpu",
    ):
        check_attention_backend(_backend("fp32-out", ReturnsFloat32), dtype=torch.bfloat16, quick=True)


def test_backend_without_sliding_window_skips_those_cases() -> None:
    check_attention_backend(_backend("no-window", NoSlidingWindow))


def test_refusing_every_configuration_fails() -> None:
    refuses = _backend(
        "refuses", TorchAttentionImpl, validate_configuration=classmethod(lambda cls, **kw: ["only on Hopper"])
    )
    with pytest.raises(
        AssertionError,
        match=r"'refuses' refuses every configuration tried for torch.float32 on cpu: "
        r"head_size=64, block_size=16: only on Hopper; ",
    ):
        check_attention_backend(refuses, quick=True)


def test_unavailable_backend_is_skipped() -> None:
    missing = _backend("missing", TorchAttentionImpl, check_available=classmethod(lambda cls: ["needs flash_attn"]))
    with pytest.raises(unittest.SkipTest, match="'missing' is not available here: needs flash_attn"):
        check_attention_backend(missing)
