"""A block is a prefix-cache hit only once its KV is written.

Regressions of issue 9 items 1 and 2: a request preempted after it was scheduled
in the same step, and a step that raises, used to leave freshly allocated (never
written) blocks registered under valid hashes; a later request "hit" them and
produced wrong tokens. The property test runs random workloads with
``debug_verify_kv_tokens``, which checks every slot a request attends to by the
token id written there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vframe import LLM, SamplingParams
from vframe.core.config import EngineConfig
from vframe.core.engine import LLMEngine
from vframe.core.worker.kv_token_check import KVCacheCorruptionError

GREEDY = dict(temperature=0.0, ignore_eos=True)
SCHED = dict(
    scheduling_policy="priority",
    max_num_batched_tokens=64,
    long_prefill_token_threshold=32,
    enable_chunked_prefill=True,
    block_size=16,
)


def run_to_end(engine: LLMEngine) -> dict[str, tuple[list[int], int, str]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, out.num_cached_tokens, c.finish_reason)
    return done


def preempt_after_scheduling(**overrides) -> tuple[dict, dict]:
    """x (low priority) prefills 32 tokens = 2 new blocks a step; in step 3, after x
    was scheduled, y needs a block, so x is preempted with 2 unwritten blocks. y
    takes one (tail first); the other stayed a "hit" before the fix."""
    llm = LLM(dtype="float32", num_threads=2, **(SCHED | overrides))
    engine = llm.llm_engine
    engine.add_request("x", {"prompt_token_ids": list(range(1000, 1096))}, SamplingParams(max_tokens=8, **GREEDY), priority=1)
    engine.step()
    engine.add_request("y", {"prompt_token_ids": list(range(3000, 3032))}, SamplingParams(max_tokens=4, **GREEDY), priority=0)
    return run_to_end(engine), engine.get_stats()


def test_request_preempted_in_the_step_that_scheduled_it_gets_correct_tokens():
    reference, _ = preempt_after_scheduling(num_gpu_blocks_override=200, enable_prefix_caching=False)
    done, stats = preempt_after_scheduling(num_gpu_blocks_override=8)
    assert stats["num_preemptions"] == 1
    assert done["x"][0] == reference["x"][0]
    assert done["x"][0][:4] == [216, 33, 33, 33]
    # 4 blocks were written before the preemption; the 2 allocated in its step were not.
    assert done["x"][1] == 64  # was 80, with wrong tokens [344, 769, 314, 253, ...]
    assert done["y"][0] == reference["y"][0] == [912, 84, 106, 103]


def test_the_kv_token_check_passes_the_preemption_scenario():
    done, _ = preempt_after_scheduling(num_gpu_blocks_override=8, debug_verify_kv_tokens=True)
    assert {r: d[2] for r, d in done.items()} == {"x": "length", "y": "length"}


def test_a_step_that_raises_fails_its_requests_and_caches_nothing_of_it(llm_fp32):
    engine = llm_fp32.llm_engine
    prompt = list(range(2000, 2064))  # 4 full blocks
    params = SamplingParams(max_tokens=6, **GREEDY)
    expected = llm_fp32.generate([{"prompt_token_ids": prompt + [5]}], params, use_tqdm=False)[0].outputs[0].token_ids
    engine.reset_prefix_cache()

    model = engine.model_runner.model
    calls = []

    def forward_that_fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected kernel failure")
        return type(model).forward(model, *args, **kwargs)

    model.forward = forward_that_fails_once
    try:
        engine.add_request("p", {"prompt_token_ids": prompt}, params)
        engine.add_request("q", {"prompt_token_ids": list(range(4000, 4010))}, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
    finally:
        del model.forward
    assert {r: c.finish_reason for r, c in done.items()} == {"p": "error", "q": "error"}
    assert "RuntimeError: injected kernel failure" in str(done["p"].error)
    assert done["p"].error.caused_by_request is False
    assert engine.kv_cache_manager.usage == 0.0

    out = llm_fp32.generate([{"prompt_token_ids": prompt + [5]}], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # was 64: the failed step's blocks were "hits"
    assert out.outputs[0].token_ids == expected


def test_the_kv_token_check_catches_a_poisoned_block():
    llm = LLM(dtype="float32", num_threads=2, block_size=16, debug_verify_kv_tokens=True)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=2, **GREEDY)
    llm.generate([{"prompt_token_ids": list(range(100, 140))}], params, use_tqdm=False)
    # Corrupt the cache on purpose: the block holding tokens 116..131 now answers
    # for tokens 216..231 as well.
    kv = engine.kv_cache_manager
    pool = kv.block_pool
    from vframe.core.request import Request

    probe = Request("probe", list(range(100, 116)) + list(range(216, 232)) + [7], params)
    block_hashes = kv._block_hashes(probe)
    pool._cached[block_hashes[1]] = pool._cached[kv._block_hashes(Request("orig", list(range(100, 140)), params))[1]]
    out = llm.generate([{"prompt_token_ids": probe.prompt_token_ids}], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 32
    assert out.outputs[0].finish_reason == "error"
    assert "KVCacheCorruptionError" in str(out.outputs[0].error)
    assert "position 16" in str(out.outputs[0].error) and "its token 216" in str(out.outputs[0].error)
    assert KVCacheCorruptionError.__name__ in str(out.outputs[0].error)


# --------------------------------------------------------------------------- #
# Property: random workloads under pressure never attend to foreign KV
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    import torch

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
    )
    LlamaForCausalLM(config).eval().save_pretrained(str(path))
    return path


requests_st = st.lists(
    st.tuples(
        st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18], []]),
        st.lists(st.integers(1, 63), min_size=1, max_size=12),  # unique tail
        st.integers(1, 8),  # max_tokens
        st.integers(0, 2),  # priority
        st.integers(0, 4),  # step at which it arrives
    ),
    min_size=2,
    max_size=8,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=requests_st,
    num_blocks=st.integers(8, 14),  # the longest request needs 8 blocks of 4
    policy=st.sampled_from(["fcfs", "priority"]),
    preemption=st.sampled_from(["recompute", "swap"]),
    chunk=st.sampled_from([0, 3, 8]),
    abort_at=st.one_of(st.none(), st.tuples(st.integers(0, 7), st.integers(1, 6))),
)
def test_every_slot_a_request_reads_holds_its_own_token(
    tiny_model, requests, num_blocks, policy, preemption, chunk, abort_at
):
    config = EngineConfig.from_sources(
        model=str(tiny_model), skip_tokenizer_init=True, dtype="float32", num_threads=1,
        block_size=4, num_gpu_blocks_override=num_blocks, max_num_batched_tokens=16,
        long_prefill_token_threshold=chunk, scheduling_policy=policy, preemption_mode=preemption,
        swap_space=0.001, debug_verify_kv_tokens=True,
    )
    engine = LLMEngine(config)
    finish = {}
    for step in range(200):
        for i, (prefix, tail, max_tokens, priority, arrival) in enumerate(requests):
            if arrival == step:
                params = SamplingParams(max_tokens=max_tokens, **GREEDY)
                priority = priority if policy == "priority" else 0
                engine.add_request(str(i), {"prompt_token_ids": prefix + tail}, params, priority=priority)
        if abort_at is not None and abort_at[1] == step:
            engine.abort_request(str(abort_at[0]))
        if not engine.has_unfinished_requests() and step > 4:
            break
        for out in engine.step() if engine.has_unfinished_requests() else []:
            if out.finished:
                finish[out.request_id] = (out.outputs[0].finish_reason, out.outputs[0].error)
    assert not engine.has_unfinished_requests()
    assert not [f for f in finish.values() if f[0] == "error"], finish
    assert engine.kv_cache_manager.usage == 0.0
