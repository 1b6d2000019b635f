"""kv_cache_dtype="fp8" (vLLM's FP8 KV cache): K/V (and DeepSeek's latent) stored
as float8 with scale 1.0 and upcast when attention reads them, on the torch and
cpu_paged backends (triton: tests/backends/test_triton_attn.py); flash_attn and flex
refuse it by name."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from vframe import LLM, SamplingParams
from vframe.backends.torch_attn import TorchAttentionImpl, TorchAttentionMetadata
from vframe.core.config import EngineConfig
from vframe.core.interfaces import CommonAttentionMetadata
from vframe.errors import ConfigError
from vframe.testing.attention import check_attention_backend
from vframe.testing.mla import check_mla_backend

FP8 = ["fp8", "fp8_e4m3", "fp8_e5m2"]


# --------------------------------------------------------------------------- #
# The torch backend against float32 attention over float8-rounded K/V
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("kv_cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_attention_reads_float8_rounded_kv(dtype: torch.dtype, kv_cache_dtype: str) -> None:
    # The kit's reference attends K/V rounded to float8 (saturated, scale 1.0) in
    # float32; attending the unrounded K/V is off by ~0.1 and fails it.
    check_attention_backend("torch", dtype=dtype, quick=dtype != torch.float32, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("kv_cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_paged_reads_float8_in_place(dtype: torch.dtype, kv_cache_dtype: str) -> None:
    # Decodes read the float8 bytes where they lie (the C++ operator's AVX2 / AVX-512 loads
    # for head sizes 64 and 128, its portable loop for the others); prefills as torch's.
    check_attention_backend("cpu_paged", dtype=dtype, quick=dtype != torch.float32, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("head_size", [64, 48])
def test_cpu_paged_widens_every_float8_byte_exactly(cache_dtype: torch.dtype, head_size: int) -> None:
    """A request of one token attends only its own value: the output is that slot's V row
    widened to float32, so each of the 256 bytes (NaN, e5m2's infinities and the
    subnormals included) must come out as torch's own conversion of it."""
    from vframe.backends.cpu_paged.build import load_ops

    load_ops()
    num_kv_heads = 256 // head_size + 1
    values = torch.arange(256, dtype=torch.uint8).repeat(2)[: num_kv_heads * head_size]
    kv_cache = torch.zeros(2, 3, 4, num_kv_heads, head_size, dtype=torch.uint8)
    kv_cache[1, 2, 1] = values.view(num_kv_heads, head_size)  # block 2, slot 1: V; K stays 0
    kv_cache = kv_cache.view(cache_dtype)
    query = torch.randn(1, num_kv_heads, head_size)
    out = torch.empty_like(query)
    torch.ops.vframe_cpu.paged_decode_attention(
        out, query, kv_cache[0], kv_cache[1], torch.tensor([[0, 2]], dtype=torch.int32),
        torch.tensor([6], dtype=torch.int32), torch.tensor([0]), torch.tensor([0]), 0.125, 1,
    )  # seq_len 6, a window of 1: only position 5 = block 2, slot 1
    expected = values.view(cache_dtype).float().view(1, num_kv_heads, head_size)
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("kv_cache_dtype", FP8)
def test_torch_mla_reads_float8_rounded_latent(kv_cache_dtype: str) -> None:
    check_mla_backend("torch", dtype=torch.float32, quick=True, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize(
    ("cache_dtype", "stored"),
    [
        # e4m3: 3 mantissa bits, largest finite 448; e5m2: 2 bits, largest 57344.
        (torch.float8_e4m3fn, [0.3125, -1.125, 448.0, -448.0, 0.0]),
        (torch.float8_e5m2, [0.3125, -1.0, 1024.0, -1024.0, 0.0]),
    ],
)
def test_cache_holds_saturated_float8(cache_dtype: torch.dtype, stored: list[float]) -> None:
    # One request of 5 tokens, 1 head of size 1: what lands in its slots.
    values = torch.tensor([0.3, -1.1, 1000.0, -1000.0, 0.0])[:, None, None]  # [T, KVH, D]
    kv_cache = torch.zeros(2, 2, 4, 1, 1, dtype=cache_dtype)  # [2, num_blocks, block_size, KVH, D]
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
        seq_lens=torch.tensor([5], dtype=torch.int32),
        context_lens=torch.tensor([0], dtype=torch.int32),
        block_table=torch.tensor([[1, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor([4, 5, 6, 7, 0]),
        num_reqs=1, num_actual_tokens=5, max_query_len=5, max_seq_len=5, block_size=4,
        query_start_loc_cpu=[0, 5], seq_lens_cpu=[5],
    )
    impl = TorchAttentionImpl(1, 1, 1.0, 1)
    impl.forward(values, values, -values, kv_cache, TorchAttentionMetadata.from_common(common))
    slots = [4, 5, 6, 7, 0]
    assert kv_cache[0].flatten()[slots].float().tolist() == stored
    assert kv_cache[1].flatten()[slots].float().tolist() == [-x for x in stored]


# --------------------------------------------------------------------------- #
# Refusals
# --------------------------------------------------------------------------- #


def test_unknown_kv_cache_dtype_is_refused_by_name() -> None:
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_sources(env={}, kv_cache_dtype="fp8_inc")
    assert (
        "kv_cache_dtype='fp8_inc' is not supported; use one of 'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'"
        in str(e.value)
    )


def test_cpu_paged_refuses_an_fp8_cache_for_float16_models() -> None:
    from vframe.plugins import get_registry

    cls = get_registry("attention_backend").load("cpu_paged")
    assert cls.validate_configuration(
        head_size=64, dtype=torch.bfloat16, device="cpu", block_size=16, kv_cache_dtype="fp8"
    ) == []
    assert cls.validate_configuration(
        head_size=64, dtype=torch.float16, device="cpu", block_size=16, kv_cache_dtype="fp8"
    ) == [
        "the cpu_paged backend reads a float8 KV cache (kv_cache_dtype='fp8') for float32 and bfloat16 models "
        "only, not float16; use dtype='bfloat16', or attention_backend='torch'"
    ]


@pytest.mark.parametrize("backend", ["flash_attn", "flex"])
def test_other_backends_refuse_fp8_by_name(backend: str) -> None:
    from vframe.plugins import get_registry

    cls = get_registry("attention_backend").load(backend)
    reasons = cls.validate_configuration(
        head_size=64, dtype=torch.bfloat16, device="cpu", block_size=16, kv_cache_dtype="fp8_e5m2"
    )
    assert f"the {backend} backend has no FP8 KV cache (kv_cache_dtype='fp8_e5m2'); use kv_cache_dtype='auto', " \
        "or attention_backend='triton' (NVIDIA GPUs) or 'torch', which serve it" in reasons


# --------------------------------------------------------------------------- #
# The engine: SmolLM2 in bfloat16, and a tiny DeepSeek-V3 (MLA)
# --------------------------------------------------------------------------- #

# SmolLM2-135M: 30 layers * 2 (K, V) * 3 kv-heads * 64 * 16 tokens = 184320 elements a block.
BF16_BLOCK_BYTES = 368640
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:"]
TEXT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital and most populous city of France. "
    "Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees."
)


def prompt_logprobs(llm: LLM, prompt: str | dict) -> list[float]:
    """The logprob of each prompt token after the first, teacher-forced."""
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]


def test_smollm2_fp8_cache_holds_twice_the_blocks_and_matches_bf16() -> None:
    common = dict(dtype="bfloat16", kv_cache_memory_bytes=24 * BF16_BLOCK_BYTES, max_model_len=256, num_threads=2)
    # Same backend for both: the comparison isolates the cache's rounding.
    bf16 = LLM(kv_cache_dtype="auto", attention_backend="torch", **common)
    fp8 = LLM(kv_cache_dtype="fp8", attention_backend="torch", **common)
    runner = fp8.llm_engine.model_runner
    assert runner.bytes_per_block() == BF16_BLOCK_BYTES // 2
    assert [c.dtype for c in runner.kv_caches] == [torch.float8_e4m3fn] * 30
    assert bf16.llm_engine.model_runner.kv_caches[0].shape[1] == 24
    assert runner.kv_caches[0].shape[1] == 48

    params = SamplingParams(max_tokens=8, temperature=0)
    expected = [o.outputs[0].token_ids for o in bf16.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in fp8.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected  # measured: identical for the first 17, 13 and 10 tokens

    # Teacher-forced over 37 tokens: measured mean |delta| 0.12, max 0.74, and a
    # perplexity 22.11 against 22.38. Non-zero: the cache really is float8.
    ref, lps = prompt_logprobs(bf16, TEXT), prompt_logprobs(fp8, TEXT)
    deltas = [abs(a - b) for a, b in zip(ref, lps)]
    assert 0.01 < sum(deltas) / len(deltas) < 0.25
    assert abs(sum(lps) - sum(ref)) / len(ref) < 0.1  # mean log-likelihood per token


def test_smollm2_fp8_cache_on_cpu_paged_as_on_torch() -> None:
    """attention_backend="auto" takes cpu_paged for an FP8 cache; its decodes read the bytes
    in place and agree with the torch backend's upcast-then-attend (float32, greedy). Not to
    the bit: a last-bit difference in one layer's output can round a later key to the next
    float8 value (3 mantissa bits), so logprobs move by up to a few 1e-2 (measured: mean
    3.8e-3, max 4.9e-2; the same two backends with a float32 cache 3.8e-6 / 1.4e-5, and
    fp8 against float32 caches 8.5e-2 / 1.38)."""
    common = dict(dtype="float32", kv_cache_dtype="fp8", max_model_len=256, num_threads=2)
    paged, torch_backend = LLM(**common), LLM(attention_backend="torch", **common)
    assert paged.llm_engine.model_runner.attn_backend.name == "cpu_paged"
    assert paged.llm_engine.model_runner.kv_caches[0].dtype == torch.float8_e4m3fn
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=0)
    deltas = []
    for a, b in zip(paged.generate(PROMPTS, params, use_tqdm=False), torch_backend.generate(PROMPTS, params, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        got = [lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        ref = [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        deltas += [abs(x - y) for x, y in zip(got, ref)]
    assert sum(deltas) / len(deltas) < 0.02 and max(deltas) < 0.25


TINY_V3 = DeepseekV3Config(
    vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, intermediate_size=96,
    max_position_embeddings=256, initializer_range=0.1, q_lora_rank=48, n_group=2, topk_group=1,
    first_k_dense_replace=1,
)


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("deepseek_v3_fp8")
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(TINY_V3).eval().save_pretrained(path)
    return str(path)


def test_deepseek_mla_fp8_latent_cache_matches_auto(tiny_deepseek: str) -> None:
    common = dict(dtype="float32", block_size=4, num_gpu_blocks_override=40, skip_tokenizer_init=True)
    auto = LLM(tiny_deepseek, kv_cache_dtype="auto", **common)
    fp8 = LLM(tiny_deepseek, kv_cache_dtype="fp8", **common)
    # block_size 4 * (kv_lora_rank 32 + qk_rope_head_dim 8) * 1 byte, one cache per layer.
    assert fp8.llm_engine.model_runner.bytes_per_block() == 4 * 40 * 3
    assert [tuple(c.shape) for c in fp8.llm_engine.model_runner.kv_caches] == [(40, 4, 40)] * 3
    assert fp8.llm_engine.model_runner.kv_caches[0].dtype == torch.float8_e4m3fn

    prompt = {"prompt_token_ids": torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(1)).tolist()}
    ref, lps = prompt_logprobs(auto, prompt), prompt_logprobs(fp8, prompt)
    # Measured: mean |delta| 0.049 over 59 tokens (max 0.86, on a token of logprob
    # ~ -5: a random model's rare tokens move most), greedy identical over 16 tokens.
    deltas = [abs(a - b) for a, b in zip(ref, lps)]
    assert 0.005 < sum(deltas) / len(deltas) < 0.1
    params = SamplingParams(max_tokens=8, temperature=0)
    assert fp8.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == \
        auto.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
