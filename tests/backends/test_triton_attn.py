"""The Triton attention backend: its kernels against the plain-PyTorch reference.

On a machine without a GPU the kernels run under Triton's interpreter. Triton
reads ``TRITON_INTERPRET`` once, when it is imported, so tests/conftest.py imports
it (and the kernels) with the variable set, then restores the environment: the
rest of the suite sees the backend as a user would (refused on the CPU), and the
tests that run it set the variable again through the ``interpreted`` fixture.
Shapes stay small: interpreted kernels are slow. The ``gpu`` tests run the
compiled kernels (on a machine with a GPU nothing is interpreted).
"""

from __future__ import annotations

import subprocess
import sys
from types import ModuleType

import pytest
import torch

# tests/conftest.py imports Triton under its interpreter on a machine without a GPU.
pytest.importorskip("triton")

from vframe.backends.triton import backend as triton_backend  # noqa: E402
from vframe.backends.triton.backend import (  # noqa: E402
    TritonAttentionImpl,
    TritonAttentionMetadata,
    plan_programs,
)
from vframe.testing.attention import ATTENTION_TOLERANCES, check_attention_backend, reference_attention  # noqa: E402
from vframe.testing.mla import check_mla_backend  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.fixture
def compiled() -> ModuleType:
    from vframe.backends.triton import kernels

    if kernels.INTERPRETED:
        pytest.skip("Triton was imported with its interpreter in this process")
    return kernels


def _decodes_split_in_three(self: TritonAttentionImpl, meta: TritonAttentionMetadata) -> int:
    return 3 if meta.block_q == 1 else 1


# --------------------------------------------------------------------------- #
# The conformance kit
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_conforms_quick_interpreted(interpreted: ModuleType, dtype: torch.dtype) -> None:
    # NaN-filled unused slots, random block tables, GQA 4 and 3, MQA, cached prefixes, mixed steps
    check_attention_backend("triton", dtype=dtype, quick=True)


@pytest.mark.parametrize(("kv_cache_dtype", "scales"), [("auto", None), ("fp8", (0.05, 3.0))])
def test_split_kv_decodes_conform_interpreted(
    interpreted: ModuleType, monkeypatch: pytest.MonkeyPatch, kv_cache_dtype: str, scales: tuple[float, float] | None
) -> None:
    # fp8: each share's partial result carries v_scale before the shares are merged
    monkeypatch.setattr(TritonAttentionImpl, "num_splits", _decodes_split_in_three)
    check_attention_backend("triton", dtype=torch.float32, quick=True, kv_cache_dtype=kv_cache_dtype,
                            kv_cache_scales=scales)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_conforms_full_interpreted(interpreted: ModuleType, dtype: torch.dtype) -> None:
    # every case (MHA, sliding window, custom scale ...), head sizes 32-256 and 80, block sizes 4, 16, 32
    check_attention_backend("triton", dtype=dtype)  # about a minute each


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mla_conforms_quick_interpreted(interpreted: ModuleType, dtype: torch.dtype) -> None:
    # the absorbed MLA form over a latent of 32 + 8: prefills, cached prefixes, mixed steps, MQA over 4-8 heads
    check_mla_backend("triton", dtype=dtype, quick=True)


@pytest.mark.slow
def test_mla_conforms_full_interpreted(interpreted: ModuleType) -> None:
    # every case, latents of 32 + 8 and DeepSeek's 512 + 64, block sizes 16, 4, 32
    check_mla_backend("triton", dtype=torch.float32)


def test_deepseek_greedy_tokens_equal_the_torch_backend_interpreted(
    interpreted: ModuleType, tmp_path: pytest.TempPathFactory
) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from vframe import LLM, SamplingParams

    config = DeepseekV3Config(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
        intermediate_size=96, first_k_dense_replace=1, max_position_embeddings=128, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(config).save_pretrained(tmp_path)
    prompts = [{"prompt_token_ids": [3, 17, 42, 99, 7, 64, 5]}, {"prompt_token_ids": [9, 8, 7]}]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def greedy(backend: str) -> list[list[int]]:
        llm = LLM(str(tmp_path), attention_backend=backend, dtype="float32", skip_tokenizer_init=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    assert greedy("triton") == greedy("torch")


# --------------------------------------------------------------------------- #
# Kernels, one mixed step: prefills with and without a cached prefix, decodes
# --------------------------------------------------------------------------- #


def _run_step(
    kernels: ModuleType,
    reqs: list[tuple[int, int]],  # (context_len, query_len) per request
    *,
    group: int,
    block_size: int,
    block_q: int,
    num_splits: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    num_kv_heads: int = 2,
    head_size: int = 32,
    sliding_window: int | None = None,
) -> None:
    """Write the step's keys through ``write_kv``, attend, compare with the reference."""
    gen = torch.Generator().manual_seed(len(reqs) * 100 + group * 10 + block_size)
    num_heads = num_kv_heads * group
    need = [-(-(c + q) // block_size) for c, q in reqs]
    num_blocks = sum(need) + 2
    free = torch.randperm(num_blocks, generator=gen).tolist()  # non-contiguous block ids
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    tables, slots, queries, keys, values, expected = [], [], [], [], [], []
    for (context_len, query_len), n in zip(reqs, need):
        seq_len = context_len + query_len
        blocks = [free.pop() for _ in range(n)]
        tables.append(blocks)
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        q = torch.randn(query_len, num_heads, head_size, generator=gen).to(dtype)
        for p in range(seq_len):
            slot = blocks[p // block_size] * block_size + p % block_size
            if p < context_len:  # cached before this step
                kv_cache[0].view(-1, num_kv_heads, head_size)[slot] = k[p]
                kv_cache[1].view(-1, num_kv_heads, head_size)[slot] = v[p]
            else:
                slots.append(slot)
        queries.append(q)
        keys.append(k[context_len:])
        values.append(v[context_len:])
        expected.append(reference_attention(q, k, v, head_size**-0.5, sliding_window))
    max_blocks = max(need)
    pad = free[0]  # a NaN block no request owns
    table = torch.tensor([t + [pad] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    query_start_loc = [0]
    for _, query_len in reqs:
        query_start_loc.append(query_start_loc[-1] + query_len)
    program_req, program_q_off = plan_programs(query_start_loc, block_q)

    def dev(x: torch.Tensor) -> torch.Tensor:
        return x.to(device)

    query = dev(torch.cat(queries))  # [T, H, D]
    kv_cache = dev(kv_cache)
    kernels.write_kv(dev(torch.cat(keys)), dev(torch.cat(values)), kv_cache, dev(torch.tensor(slots)))
    out = torch.full_like(query, float("nan"))
    kernels.paged_attention(
        out,
        query,
        kv_cache,
        dev(table),
        dev(torch.tensor([c + q for c, q in reqs], dtype=torch.int32)),
        dev(torch.tensor(query_start_loc, dtype=torch.int32)),
        dev(torch.from_numpy(program_req)),
        dev(torch.from_numpy(program_q_off)),
        block_q=block_q,
        scale=head_size**-0.5,
        sliding_window=sliding_window,
        num_splits=num_splits,
    )
    atol, rtol = ATTENTION_TOLERANCES[dtype]
    torch.testing.assert_close(out.float().cpu(), torch.cat(expected), atol=atol, rtol=rtol)


# (context_len, query_len): lengths that are no multiple of the block size.
MIXED = [(0, 7), (21, 5), (37, 1), (0, 1), (9, 1)]


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_mixed_step_interpreted(interpreted: ModuleType, group: int, num_splits: int) -> None:
    _run_step(interpreted, MIXED, group=group, block_size=8, block_q=4, num_splits=num_splits)


def test_head_size_no_power_of_two_and_sliding_window_interpreted(interpreted: ModuleType) -> None:
    # head size 80 runs padded to 128 lanes; the window of 6 cuts into the cached prefixes
    _run_step(
        interpreted, MIXED, group=3, block_size=16, block_q=4, num_splits=2, head_size=80, sliding_window=6
    )


def test_long_decodes_split_kv_interpreted(interpreted: ModuleType) -> None:
    # 5 splits of a 10-tile context; the short request leaves most splits empty
    reqs = [(299, 1), (2, 1), (180, 1)]
    _run_step(interpreted, reqs, group=3, block_size=16, block_q=1, num_splits=5)


def test_padding_rows_are_zero_interpreted(interpreted: ModuleType) -> None:
    from vframe.core.interfaces import CommonAttentionMetadata

    impl = TritonAttentionImpl(4, 32, 32**-0.5, 2)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        seq_lens=torch.tensor([3], dtype=torch.int32),
        context_lens=torch.tensor([0], dtype=torch.int32),
        block_table=torch.tensor([[1]], dtype=torch.int32),
        slot_mapping=torch.tensor([16, 17, 18]),
        num_reqs=1,
        num_actual_tokens=3,
        max_query_len=3,
        max_seq_len=3,
        block_size=16,
        query_start_loc_cpu=[0, 3],
        seq_lens_cpu=[3],
    )
    meta = triton_backend.TritonAttentionMetadataBuilder(None, torch.device("cpu")).build(common)
    cache = torch.full((2, 2, 16, 2, 32), float("nan"))
    out = impl.forward(torch.randn(5, 4, 32), torch.randn(5, 2, 32), torch.randn(5, 2, 32), cache, meta)
    assert out[:3].isfinite().all()
    assert (out[3:] == 0).all()


# --------------------------------------------------------------------------- #
# A float8 cache (kv_cache_dtype="fp8"), with and without calibrated scales
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("kv_cache_dtype", "dtype", "scales"),
    [  # each format, each dtype and scales in make test; the rest of the pairs by `make test-slow`
        pytest.param("fp8", torch.float32, None, marks=pytest.mark.slow),
        pytest.param("fp8", torch.bfloat16, None, marks=pytest.mark.slow),
        ("fp8_e5m2", torch.float16, None),
        ("fp8", torch.float32, (0.05, 3.0)),
        ("fp8_e5m2", torch.bfloat16, (4.0, 0.25)),
    ],
)
def test_float8_cache_conforms_quick_interpreted(
    interpreted: ModuleType, kv_cache_dtype: str, dtype: torch.dtype, scales: tuple[float, float] | None
) -> None:
    # the cache's bytes must be torch's fp8(x / scale) exactly; outputs against float32
    # attention over the stored values times the scales (a dropped scale is off by ~3)
    check_attention_backend("triton", dtype=dtype, quick=True, kv_cache_dtype=kv_cache_dtype, kv_cache_scales=scales)


@pytest.mark.parametrize(("kv_cache_dtype", "dtype"), [("fp8", torch.float32), ("fp8_e5m2", torch.bfloat16)])
def test_float8_cache_with_per_head_scales_conforms_quick_interpreted(
    interpreted: ModuleType, kv_cache_dtype: str, dtype: torch.dtype
) -> None:
    # plugin API 1.22: each KV head over its own scales (the kit's 1, 1/4, 4, 1/2 times these)
    check_attention_backend("triton", dtype=dtype, quick=True, kv_cache_dtype=kv_cache_dtype,
                            kv_cache_scales=(0.05, 3.0), per_head_kv_scales=True)


@pytest.mark.parametrize(("kv_cache_dtype", "dtype", "scale"), [("fp8", torch.float32, None),
                                                                 ("fp8_e5m2", torch.bfloat16, 0.1)])
def test_mla_float8_cache_conforms_quick_interpreted(
    interpreted: ModuleType, kv_cache_dtype: str, dtype: torch.dtype, scale: float | None
) -> None:
    check_mla_backend("triton", dtype=dtype, quick=True, kv_cache_dtype=kv_cache_dtype, kv_cache_scale=scale)


def _float8_values(cache_dtype: torch.dtype) -> torch.Tensor:
    """Float32 values that find every rounding case of ``cache_dtype``: each finite value,
    each midpoint between neighbours (ties go to the even one) and one float32 step to
    either side of it, past the largest value, infinities, NaN, signed zeros and float32's
    subnormals, then random values from 1e-12 to 1e6."""
    finite = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(cache_dtype).float()
    finite = finite[finite.isfinite()].unique()
    mids = (finite[:-1] + finite[1:]) / 2
    step = lambda x, k: (x.view(torch.int32) + k).view(torch.float32)  # noqa: E731
    limit = torch.finfo(cache_dtype).max
    special = [0.0, -0.0, limit * 1.01, -limit * 3, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-42]
    random = torch.randn(20_000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-12, 6, 20_000)
    return torch.cat([finite, mids, step(mids, 1), step(mids, -1), torch.tensor(special), random])


def _check_float8_writes(kernels: ModuleType, cache_dtype: torch.dtype, device: str) -> None:
    """Every byte ``write_kv`` stores must be torch's clamp(x / scale).to(float8), on the CPU."""
    from vframe.backends.torch_attn import to_cache_dtype

    values = _float8_values(cache_dtype)
    rows = -(-values.shape[0] // 64)
    values = torch.cat([values, torch.zeros(rows * 64 - values.shape[0])]).view(rows, 2, 32)
    key, value = values * 0.75, values * 2.0  # stored as x / 0.75 and x / 2
    cache = torch.zeros(2, rows, 1, 2, 32, dtype=cache_dtype, device=device)  # block size 1: token t in block t
    kernels.write_kv(key.to(device), value.to(device), cache, torch.arange(rows, device=device), k_scale=0.75,
                     v_scale=2.0)
    for stored, x, scale in ((cache[0, :, 0], key, 0.75), (cache[1, :, 0], value, 2.0)):
        expected = to_cache_dtype(x / scale, cache_dtype)
        assert torch.equal(stored.cpu().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_writes_round_as_torch_interpreted(interpreted: ModuleType, cache_dtype: torch.dtype) -> None:
    # the kernel rounds in integers: the interpreter's own float8 conversion gets carries wrong
    _check_float8_writes(interpreted, cache_dtype, "cpu")


@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")  # the NaN bytes
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_float8_byte_widens_exactly_interpreted(interpreted: ModuleType, cache_dtype: torch.dtype) -> None:
    """A request of one token attends only its own value: the output is that slot's V row
    widened, so each of the 256 bytes (NaN, e5m2's infinities, the subnormals) must come
    out as torch's own conversion of it."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(4, 64)  # 4 kv-heads of 64
    cache = torch.zeros(2, 2, 16, 4, 64, dtype=torch.uint8)
    cache[1, 1, 0] = codes  # V of block 1, slot 0; K stays 0
    out = torch.empty(1, 4, 64)
    interpreted.paged_attention(
        out, torch.randn(1, 4, 64), cache.view(cache_dtype), torch.tensor([[1]], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), block_q=1, scale=0.125,
    )  # fmt: skip
    expected = codes.view(cache_dtype).float()[None]
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out.nan_to_num(), expected.nan_to_num())


# --------------------------------------------------------------------------- #
# Planning
# --------------------------------------------------------------------------- #


def test_plan_programs_cuts_requests_into_query_blocks() -> None:
    program_req, program_q_off = plan_programs([0, 20, 21, 21, 37], 16)
    assert program_req.tolist() == [0, 0, 1, 3]
    assert program_q_off.tolist() == [0, 16, 0, 0]


def _meta(block_q: int, num_programs: int, max_seq_len: int, num_sms: int) -> TritonAttentionMetadata:
    empty = torch.empty(0)
    return TritonAttentionMetadata(
        empty, 0, empty, empty, empty, torch.zeros(num_programs), empty, block_q, max_seq_len, num_sms
    )


def test_num_splits_only_for_long_decodes_that_leave_the_gpu_idle() -> None:
    impl = TritonAttentionImpl.__new__(TritonAttentionImpl)
    impl.num_kv_heads = 8
    # 4 decodes x 8 KV heads = 32 programs on 132 SMs: 4 splits, 4096 // 512 = 8 allowed
    assert impl.num_splits(_meta(1, 4, 4096, 132)) == 4
    assert impl.num_splits(_meta(1, 4, 1024, 132)) == 2  # at least 512 keys per split
    assert impl.num_splits(_meta(1, 4, 300, 132)) == 1
    assert impl.num_splits(_meta(1, 64, 4096, 132)) == 1  # the GPU is already full
    assert impl.num_splits(_meta(16, 4, 4096, 132)) == 1  # a step with prefills
    assert impl.num_splits(_meta(1, 4, 4096, 1)) == 1  # off the GPU


# --------------------------------------------------------------------------- #
# Importing and end to end
# --------------------------------------------------------------------------- #


def test_listing_the_backend_imports_no_triton() -> None:
    code = (
        "import sys, vframe\n"
        "from vframe.plugins import get_registry\n"
        "cls = get_registry('attention_backend').load('triton')\n"
        "cls.validate_configuration(head_size=64, dtype=__import__('torch').float32, device='cuda', block_size=16)\n"
        "assert 'vframe.backends.triton.kernels' not in sys.modules\n"
        "assert not any(m == 'triton.language' for m in sys.modules), 'triton.language imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _greedy_tokens(
    attention_backend: str, prompts: list[str], max_tokens: int, kv_cache_dtype: str = "auto"
) -> list[list[int]]:
    from vframe import LLM, SamplingParams

    llm = LLM(attention_backend=attention_backend, dtype="float32", num_threads=2, num_gpu_blocks_override=16,
              kv_cache_dtype=kv_cache_dtype)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_greedy_tokens_equal_the_torch_backend_interpreted(interpreted: ModuleType, kv_cache_dtype: str) -> None:
    # a prefill of two prompts, then a decode of both: about 3 s a step interpreted
    prompts = ["The capital of France is", "def add(a, b):"]
    expected = _greedy_tokens("torch", prompts, 2, kv_cache_dtype)
    assert _greedy_tokens("triton", prompts, 2, kv_cache_dtype) == expected


@pytest.mark.slow
def test_more_greedy_tokens_equal_the_torch_backend_interpreted(interpreted: ModuleType) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]
    assert _greedy_tokens("triton", prompts, 8) == _greedy_tokens("torch", prompts, 8)


# --------------------------------------------------------------------------- #
# GPU: the compiled kernels
# --------------------------------------------------------------------------- #


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_conforms_on_gpu(compiled: ModuleType, dtype: torch.dtype) -> None:
    check_attention_backend("triton", dtype=dtype, device="cuda")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mla_conforms_on_gpu(compiled: ModuleType, dtype: torch.dtype) -> None:
    check_mla_backend("triton", dtype=dtype, device="cuda")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_split_kv_conforms_on_gpu(compiled: ModuleType, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    monkeypatch.setattr(TritonAttentionImpl, "num_splits", _decodes_split_in_three)
    check_attention_backend("triton", dtype=dtype, device="cuda")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float8_cache_conforms_on_gpu(compiled: ModuleType, dtype: torch.dtype, kv_cache_dtype: str) -> None:
    check_attention_backend("triton", dtype=dtype, device="cuda", kv_cache_dtype=kv_cache_dtype)
    check_attention_backend("triton", dtype=dtype, device="cuda", quick=True, kv_cache_dtype=kv_cache_dtype,
                            kv_cache_scales=(0.05, 3.0))
    check_attention_backend("triton", dtype=dtype, device="cuda", quick=True, kv_cache_dtype=kv_cache_dtype,
                            kv_cache_scales=(0.05, 3.0), per_head_kv_scales=True)
    check_mla_backend("triton", dtype=dtype, device="cuda", kv_cache_dtype=kv_cache_dtype, kv_cache_scale=0.1)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_writes_round_as_torch_on_gpu(compiled: ModuleType, cache_dtype: torch.dtype) -> None:
    _check_float8_writes(compiled, cache_dtype, "cuda")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 8])
def test_long_context_on_gpu(compiled: ModuleType, dtype: torch.dtype, num_splits: int) -> None:
    reqs = [(4000, 1), (3, 1), (2500, 1), (700, 33), (0, 300)]
    _run_step(
        compiled, reqs, group=4, block_size=16, block_q=16, num_splits=num_splits, dtype=dtype,
        device="cuda", num_kv_heads=4, head_size=128,
    )  # fmt: skip


@pytest.mark.gpu
@cuda
def test_auto_picks_triton_at_block_size_16_and_matches_torch_on_gpu(compiled: ModuleType) -> None:
    from vframe import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    # flash_attn comes first on CUDA but needs block_size 256 (and float16/bfloat16)
    auto = LLM(dtype="float32", device="cuda")
    assert auto.llm_engine.model_runner.attn_backend.name == "triton"
    ours = LLM(attention_backend="triton", dtype="float32", device="cuda").generate(prompts, params)
    theirs = LLM(attention_backend="torch", dtype="float32", device="cuda").generate(prompts, params)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]


@pytest.mark.gpu
@cuda
def test_auto_picks_triton_for_a_float8_cache_and_matches_torch_on_gpu(compiled: ModuleType) -> None:
    from vframe import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    common = dict(dtype="bfloat16", device="cuda", kv_cache_dtype="fp8")
    auto = LLM(**common)  # flash_attn refuses a float8 cache
    assert auto.llm_engine.model_runner.attn_backend.name == "triton"
    assert auto.llm_engine.model_runner.kv_caches[0].dtype == torch.float8_e4m3fn
    theirs = LLM(attention_backend="torch", **common).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in auto.generate(prompts, params)] == [o.outputs[0].token_ids for o in theirs]
