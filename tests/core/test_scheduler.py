"""The default scheduler on tiny configurations, driven without a model:
each step "samples" token 7 for every request that reached its last token."""

import pytest

from vframe.core.config import EngineConfig
from vframe.core.outputs import ModelRunnerOutput, SchedulerOutput
from vframe.core.request import Request, RequestStatus
from vframe.core.sampling_params import SamplingParams
from vframe.core.sched.kv_cache_manager import PagedKVCacheManager
from vframe.core.sched.scheduler import DefaultScheduler


def make_scheduler(num_blocks=16, block_size=4, budget=8, max_num_seqs=4, caching=False, **kw):
    config = EngineConfig.from_sources(
        env={}, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, block_size=block_size, **kw
    )
    kv = PagedKVCacheManager(num_blocks, block_size, enable_caching=caching)
    return DefaultScheduler(config, kv), kv


def request(req_id, num_prompt, max_tokens=3, offset=0):
    return Request(req_id, list(range(offset, offset + num_prompt)), SamplingParams(max_tokens=max_tokens))


def fake_run(sched: DefaultScheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    sampled = {
        rid: 7
        for rid in out.num_scheduled_tokens
        if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens
    }
    return ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)


def step(sched):
    out = sched.schedule()
    return out, sched.update_from_output(out, fake_run(sched, out))


def test_chunked_prefill_splits_a_long_prompt_and_decodes_go_first():
    sched, kv = make_scheduler(budget=4)
    sched.add_request(request("a", 3, max_tokens=3))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 3}
    sched.add_request(request("b", 10, max_tokens=1))
    out, _ = step(sched)
    # a's decode comes first, b's prefill takes the remaining 3 tokens of the budget
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}
    out, core = step(sched)
    assert out.num_scheduled_tokens == {"b": 4}  # a finished after 3 tokens
    assert [(c.req_id, c.new_token_ids, c.finish_reason.value) for c in core] == [("b", [7], "length")]
    assert not sched.has_unfinished_requests()
    assert kv.num_free_blocks == 16


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched, _ = make_scheduler(budget=8, enable_chunked_prefill=False)
    sched.add_request(request("a", 6))
    sched.add_request(request("b", 6))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 6}


def test_max_num_seqs_caps_the_running_set():
    sched, _ = make_scheduler(budget=64, max_num_seqs=2)
    for i in range(3):
        sched.add_request(request(f"r{i}", 2))
    out, _ = step(sched)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}


def test_recompute_preemption_frees_the_last_request_and_requeues_it_first():
    # 4 blocks of 4 tokens: two 7-token prompts take 2 blocks each; the first
    # decode that crosses into a new block must preempt.
    sched, kv = make_scheduler(num_blocks=4, block_size=4, budget=64)
    sched.add_request(request("a", 7, max_tokens=4))
    sched.add_request(request("b", 7, max_tokens=4, offset=100))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 7, "b": 7}
    out, _ = step(sched)  # tokens at position 7 fit in the second block
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    out, _ = step(sched)  # position 8 needs a third block each: b is preempted
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.preempted_req_ids == {"b"}
    b = next(iter(sched.waiting))
    assert b.request_id == "b" and b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    while sched.has_unfinished_requests():
        step(sched)
    assert b.output_token_ids == [7, 7, 7, 7]
    assert kv.num_free_blocks == 4


def test_abort_frees_blocks_of_running_and_waiting_requests():
    sched, kv = make_scheduler(budget=64, max_num_seqs=1)
    sched.add_request(request("a", 5))
    sched.add_request(request("b", 5))
    step(sched)
    assert kv.num_free_blocks == 14
    aborted = sched.abort_requests(["a", "b", "unknown"])
    assert [r.status for r in aborted] == [RequestStatus.FINISHED_ABORTED] * 2
    assert kv.num_free_blocks == 16
    assert not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == {"a"}  # the runner is told to drop a's state


@pytest.mark.parametrize("policy_order", [([3, 1, 2], ["b", "c", "a"])])
def test_priority_policy_admits_lowest_value_first(policy_order):
    priorities, expected = policy_order
    sched, _ = make_scheduler(budget=64, max_num_seqs=1, scheduling_policy="priority")
    for rid, prio in zip("abc", priorities):
        r = request(rid, 2, max_tokens=1)
        r.priority = prio
        sched.add_request(r)
    order = []
    while sched.has_unfinished_requests():
        _, core = step(sched)
        order += [c.req_id for c in core if c.finished]
    assert order == expected


def test_long_prefill_token_threshold_caps_one_prompt_per_step():
    sched, _ = make_scheduler(budget=16, long_prefill_token_threshold=5)
    sched.add_request(request("long", 12))
    sched.add_request(request("short", 3))
    out, _ = step(sched)
    # "long" may take only 5 of the 16 tokens; "short" fits in what is left.
    assert out.num_scheduled_tokens == {"long": 5, "short": 3}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"long": 5, "short": 1}


def test_swap_preemption_keeps_computed_tokens_and_copies_blocks_back():
    config = EngineConfig.from_sources(
        env={}, max_num_batched_tokens=64, max_num_seqs=4, block_size=4, preemption_mode="swap"
    )
    kv = PagedKVCacheManager(4, 4, enable_caching=False, num_swap_blocks=4)
    sched = DefaultScheduler(config, kv)
    sched.add_request(request("a", 7, max_tokens=4))
    sched.add_request(request("b", 7, max_tokens=4, offset=100))
    step(sched)
    step(sched)
    out, _ = step(sched)  # position 8 needs a third block each: b is swapped out
    assert out.preempted_req_ids == {"b"}
    assert out.blocks_to_swap_out == [(2, 0), (3, 1)]
    b = sched.requests["b"]
    assert b.status == RequestStatus.SWAPPED and b.num_computed_tokens == 8
    while "b" not in {r.request_id for r in sched.running}:
        out, _ = step(sched)
    assert out.blocks_to_swap_in and [s for s, _ in out.blocks_to_swap_in] == [0, 1]
    assert out.num_scheduled_tokens["b"] == 1  # only the pending token: nothing recomputed
    while sched.has_unfinished_requests():
        step(sched)
    assert b.output_token_ids == [7, 7, 7, 7] and kv.num_free_blocks == 4


def test_swap_mode_without_swap_space_is_a_config_error():
    from vframe.errors import ConfigError

    config = EngineConfig.from_sources(env={}, max_num_batched_tokens=8, preemption_mode="swap")
    with pytest.raises(ConfigError, match="preemption_mode='swap' needs a swap space"):
        DefaultScheduler(config, PagedKVCacheManager(4, 4, enable_caching=False))


# --------------------------------------------------------------------------- #
# LoRA: at most max_loras distinct adapters among running requests
# --------------------------------------------------------------------------- #


def lora_request(req_id, lora_int_id, num_prompt=2, max_tokens=2):
    from vframe.lora.request import LoRARequest

    adapter = None if lora_int_id is None else LoRARequest(f"adapter{lora_int_id}", lora_int_id, f"/adapters/{lora_int_id}")
    return Request(req_id, [1] * num_prompt, SamplingParams(max_tokens=max_tokens), lora_request=adapter)


def test_running_requests_use_at_most_max_loras_adapters_and_the_blocked_one_is_next():
    sched, _ = make_scheduler(budget=16, max_num_seqs=8, enable_lora=True, max_loras=2)
    for req_id, lora_id in [("a1", 1), ("b", None), ("a2", 2), ("a3", 3), ("a1b", 1), ("base", None)]:
        sched.add_request(lora_request(req_id, lora_id, max_tokens=3 if req_id == "a1" else 2))
    out, _ = step(sched)
    # adapters 1 and 2 fill both slots; a3 (adapter 3) waits at the head and so does everyone behind it
    assert list(out.num_scheduled_tokens) == ["a1", "b", "a2"]
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["a1", "b", "a2"]
    out, _ = step(sched)
    # b and a2 finished after 2 tokens: adapter 2's slot is free, a3 and everyone behind it run
    assert list(out.num_scheduled_tokens) == ["a1", "a3", "a1b", "base"]


def test_without_enable_lora_adapters_are_not_counted():
    sched, _ = make_scheduler(budget=16, max_num_seqs=8)
    for req_id, lora_id in [("a1", 1), ("a2", 2), ("a3", 3)]:
        sched.add_request(lora_request(req_id, lora_id))
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["a1", "a2", "a3"]
    assert [r.lora_request.lora_int_id for r in out.scheduled_new_reqs] == [1, 2, 3]


def test_prefix_cache_blocks_are_keyed_by_adapter():
    sched, kv = make_scheduler(budget=32, max_num_seqs=8, caching=True, enable_lora=True, max_loras=4)
    prompt = 9  # two full blocks of 4, then one token
    for req_id, lora_id in [("first", 1), ("same", 1), ("other", 2), ("base", None)]:
        sched.add_request(lora_request(req_id, lora_id, num_prompt=prompt, max_tokens=1))
        step(sched)
    # only the request with the same adapter as the first hits its two full blocks
    assert kv.get_stats()["prefix_cache_hits"] == 8
