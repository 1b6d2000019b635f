"""The FlexAttention backend (``flex``): the conformance kit on its compiled
path (inductor's C++ template on the CPU) and its eager one, greedy tokens
against the torch backend, its refusals, and that listing it imports no
``flex_attention``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from vframe.backends.flex.backend import FlexAttentionBackend, compile_failure
from vframe.testing.attention import check_attention_backend

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)]  # bfloat16: ~25-60 s of compiles
)
def test_conforms_quick_compiled(dtype: torch.dtype) -> None:
    # NaN-filled unused slots, random block tables, GQA 4 and 3, MQA, cached prefixes, mixed steps;
    # compiled by inductor (each case's cache size is a new static key length: ~10 s of compiling each)
    check_attention_backend("flex", dtype=dtype, quick=True)
    assert compile_failure() is None


@pytest.mark.slow  # every case of the kit, compiled: 9 minutes of inductor compiles on this 2-core machine
def test_conforms_full_float32_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    # every case (MHA, sliding window, custom scale ...), head sizes 32-256 and 80, block sizes 16, 32;
    # each case's cache size is another static key length, past the 64 variants an engine may compile
    import vframe.backends.flex.backend as flex

    monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 4096)
    check_attention_backend("flex", dtype=torch.float32)
    assert compile_failure() is None


def test_eager_plan_conforms_quick(monkeypatch: pytest.MonkeyPatch) -> None:
    # enforce_eager=True: the builder hands out the eager plan (unfused flex_attention over gathered blocks)
    import vframe.testing.attention as kit

    def eager_config(*args, **kwargs):  # type: ignore[no-untyped-def]
        config = engine_config(*args, **kwargs)
        config.device.enforce_eager = True
        return config

    engine_config = kit._engine_config
    monkeypatch.setattr(kit, "_engine_config", eager_config)
    check_attention_backend("flex", dtype=torch.float32, quick=True)


@pytest.mark.gpu
@cuda
def test_conforms_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # compiled: inductor's Triton template; every case, so more variants than an engine's 64 (see the CPU test)
    import vframe.backends.flex.backend as flex

    monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 4096)
    check_attention_backend("flex", dtype=torch.bfloat16, device="cuda")
    assert compile_failure() is None


def test_refusals_say_why() -> None:
    reasons = FlexAttentionBackend.validate_configuration(
        head_size=64, dtype=torch.float16, device="cpu", block_size=8, use_mla=True
    )
    assert len(reasons) == 3
    assert "no multi-head latent attention" in reasons[0]
    assert "float16 on the CPU" in reasons[1]
    assert "block_size 8" in reasons[2] and "16, 32, 64, 128" in reasons[2]
    assert FlexAttentionBackend.validate_configuration(
        head_size=64, dtype=torch.bfloat16, device="cpu", block_size=16
    ) == []
    assert FlexAttentionBackend.check_available() == []


def test_listing_the_backend_imports_no_flex_attention() -> None:
    code = (
        "import sys, torch, vframe\n"
        "from vframe.plugins import get_registry\n"
        "cls = get_registry('attention_backend').load('flex')\n"
        "assert cls.check_available() == []\n"
        "cls.validate_configuration(head_size=64, dtype=torch.float32, device='cpu', block_size=16)\n"
        "assert 'torch.nn.attention.flex_attention' not in sys.modules, 'flex_attention imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _greedy_tokens(attention_backend: str, prompts: list[str], max_tokens: int, **kwargs) -> list[list[int]]:
    from vframe import LLM, SamplingParams

    llm = LLM(
        attention_backend=attention_backend, dtype="float32", num_threads=2, num_gpu_blocks_override=16, **kwargs
    )
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_tokens_equal_the_torch_backend() -> None:
    prompts = ["The capital of France is", "def add(a, b):"]
    want = _greedy_tokens("torch", prompts, 6)
    assert _greedy_tokens("flex", prompts, 6) == want  # compiled
    assert compile_failure() is None
    assert _greedy_tokens("flex", prompts, 6, enforce_eager=True) == want


def test_a_shared_prefix_block_matches_the_torch_backend() -> None:
    # r0 and r1 both hold physical block 2 as their first (prefix-cached) block;
    # r0 decodes position 19 (blocks [2, 4]), r1 prefills positions 16..18 (blocks [2, 5]).
    from vframe.backends.flex.backend import FlexAttentionImpl, FlexAttentionMetadata, FlexPagedPlan
    from vframe.backends.torch_attn import TorchAttentionImpl
    from vframe.core.interfaces import CommonAttentionMetadata

    torch.manual_seed(0)
    bs, kvh, h, d, num_blocks = 16, 2, 4, 32, 6
    cache = torch.full((2, num_blocks, bs, kvh, d), float("nan"))
    cache[:, 2] = torch.randn(2, bs, kvh, d)  # the shared prefix
    cache[:, 4, :3] = torch.randn(2, 3, kvh, d)  # r0's positions 16..18
    slots = [4 * bs + 3, 5 * bs + 0, 5 * bs + 1, 5 * bs + 2]
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32),
        seq_lens=torch.tensor([20, 19], dtype=torch.int32),
        context_lens=torch.tensor([19, 16], dtype=torch.int32),
        block_table=torch.tensor([[2, 4], [2, 5]], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_reqs=2,
        num_actual_tokens=4,
        max_query_len=3,
        max_seq_len=20,
        block_size=bs,
        query_start_loc_cpu=[0, 1, 4],
        seq_lens_cpu=[20, 19],
    )
    q, k, v = torch.randn(4, h, d), torch.randn(4, kvh, d), torch.randn(4, kvh, d)
    for window in (None, 5):
        for plan in (FlexAttentionMetadata.from_common(common), FlexPagedPlan.from_common(common)):
            flex_cache, torch_cache = cache.clone(), cache.clone()
            got = FlexAttentionImpl(h, d, d**-0.5, kvh, sliding_window=window).forward(q, k, v, flex_cache, plan)
            want = TorchAttentionImpl(h, d, d**-0.5, kvh, sliding_window=window).forward(q, k, v, torch_cache, common)
            torch.testing.assert_close(got, want)
            if isinstance(plan, FlexPagedPlan):  # the compiled path zeroes the unwritten tails of last blocks
                assert (flex_cache[:, 4, 4:] == 0).all() and (flex_cache[:, 5, 3:] == 0).all()
                flex_cache[:, 4, 4:] = torch_cache[:, 4, 4:]
                flex_cache[:, 5, 3:] = torch_cache[:, 5, 3:]
            torch.testing.assert_close(flex_cache, torch_cache, equal_nan=True)
    assert compile_failure() is None
