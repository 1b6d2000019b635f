"""Batching, preemption and chunking must not change greedy outputs."""

import pytest

from vframe import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The three primary colours are",
    "In 1969, the first humans",
    "A haiku about autumn:",
    "The largest planet in the solar system is",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
# float32 KV bytes per 16-token block: 2 (K, V) * 30 layers * 16 * 3 heads * 64 * 4 bytes
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4


def texts(llm, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def batched(llm_fp32) -> list[list[int]]:
    return texts(llm_fp32, PROMPTS)


def test_alone_equals_batched(llm_fp32, batched):
    alone = [texts(llm_fp32, [p])[0] for p in PROMPTS[:3]]
    assert alone == batched[:3]


def test_preemption_does_not_change_outputs(batched):
    # 7 blocks for 6 requests that each need 2-3: most steps must preempt someone.
    llm = LLM(dtype="float32", max_model_len=64, kv_cache_memory_bytes=7 * BLOCK_BYTES, num_threads=2)
    assert texts(llm, PROMPTS) == batched
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_cache_usage"] == 0.0  # every block came back


# the smallest budget (every prompt chunked) and the default's in make test; 16 and 64 by `make test-slow`
@pytest.mark.parametrize(
    "budget", [4, pytest.param(16, marks=pytest.mark.slow), pytest.param(64, marks=pytest.mark.slow), 2048]
)
def test_token_budget_does_not_change_outputs(batched, budget):
    llm = LLM(dtype="float32", max_num_batched_tokens=budget, max_num_seqs=3, num_threads=2)
    assert texts(llm, PROMPTS) == batched


def test_prefix_caching_off_gives_the_same_outputs(batched):
    llm = LLM(dtype="float32", enable_prefix_caching=False, num_threads=2)
    assert texts(llm, PROMPTS) == batched
    assert llm.get_stats()["prefix_cache_queries"] == 0


def test_swap_preemption_does_not_change_outputs(batched):
    llm = LLM(
        dtype="float32", max_model_len=64, kv_cache_memory_bytes=7 * BLOCK_BYTES, num_threads=2,
        preemption_mode="swap", swap_space=0.05,
    )
    assert texts(llm, PROMPTS) == batched
    stats = llm.get_stats()
    assert stats["num_swap_preemptions"] > 0
    assert stats["kv_cache_usage"] == 0.0 and stats["swap_space_usage"] == 0.0
