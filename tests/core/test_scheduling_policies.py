"""Scheduling policies (plugin API 1.2): which waiting request the default scheduler
admits next and which running one it preempts, chosen by name in the registry.
Driven without a model, as in test_scheduler.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vframe.core.config import EngineConfig
from vframe.core.interfaces import RequestView, SchedulingPolicy
from vframe.core.outputs import ModelRunnerOutput
from vframe.core.request import Request
from vframe.core.sampling_params import SamplingParams
from vframe.core.sched.kv_cache_manager import PagedKVCacheManager
from vframe.core.sched.policies import FirstComeFirstServed, PriorityPolicy
from vframe.core.sched.scheduler import DefaultScheduler
from vframe.errors import InvalidRequestError, PluginError
from vframe.plugins import get_registry, hookimpl, register_plugin, unregister_plugin


def make_scheduler(
    policy: str, num_blocks: int = 16, budget: int = 64, max_num_seqs: int = 4
) -> DefaultScheduler:
    config = EngineConfig.from_sources(
        env={}, scheduling_policy=policy, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
        block_size=4,
    )
    return DefaultScheduler(config, PagedKVCacheManager(num_blocks, 4, enable_caching=False))


def request(req_id: str, num_prompt: int, *, priority: int = 0, arrival_time: float | None = None) -> Request:
    prompt = list(range(100 * len(req_id), 100 * len(req_id) + num_prompt))
    return Request(req_id, prompt, SamplingParams(max_tokens=4, ignore_eos=True), arrival_time, priority)


def step(sched: DefaultScheduler):
    out = sched.schedule()
    sampled = {
        rid: 7
        for rid in out.num_scheduled_tokens
        if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens
    }
    sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))
    return out


def admission_order(sched: DefaultScheduler) -> list[str]:
    admitted: list[str] = []
    while sched.has_unfinished_requests():
        admitted += [r.req_id for r in step(sched).scheduled_new_reqs if r.req_id not in admitted]
    return admitted


def test_the_builtin_policies_are_registered_by_name():
    registry = get_registry("scheduling_policy")
    assert registry.load("fcfs") is FirstComeFirstServed
    assert registry.load("priority") is PriorityPolicy
    assert (FirstComeFirstServed.uses_priority, PriorityPolicy.uses_priority) == (False, True)


def test_priority_admits_lowest_value_first_ties_by_arrival():
    sched = make_scheduler("priority", max_num_seqs=1)
    for rid, prio in [("a", 2), ("b", 0), ("c", 1), ("d", 0)]:
        sched.add_request(request(rid, 2, priority=prio))
    assert admission_order(sched) == ["b", "d", "c", "a"]


@pytest.mark.parametrize(
    ("policy", "scheduled", "preempted"),
    [
        ("fcfs", {"a": 1}, {"b"}),  # the latest admitted goes, whatever its priority
        ("priority", {"b": 1}, {"a"}),  # the largest priority value goes, though admitted first
    ],
)
def test_the_victim_is_the_request_the_policy_ranks_last(policy, scheduled, preempted):
    # 4 blocks of 4: two 7-token prompts take 2 blocks each; at position 8 each needs a third.
    sched = make_scheduler(policy, num_blocks=4)
    sched.add_request(request("a", 7, priority=5))
    sched.add_request(request("b", 7, priority=0))
    step(sched)
    step(sched)
    out = step(sched)
    assert out.num_scheduled_tokens == scheduled
    assert out.preempted_req_ids == preempted


def test_fcfs_puts_a_preempted_request_back_at_the_very_front():
    # All three arrive at the same instant: the preempted b still goes before c,
    # which has waited since the first step for a free block.
    sched = make_scheduler("fcfs", num_blocks=4)
    for rid, num_prompt in [("a", 7), ("b", 7), ("c", 1)]:
        sched.add_request(request(rid, num_prompt, arrival_time=0.0))
    assert step(sched).num_scheduled_tokens == {"a": 7, "b": 7}
    step(sched)
    assert step(sched).preempted_req_ids == {"b"}
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_an_unknown_policy_name_lists_the_known_ones():
    with pytest.raises(PluginError, match=r"unknown scheduling policy 'fastest'; known: fcfs, priority"):
        make_scheduler("fastest")


class LongestPromptFirst(SchedulingPolicy):
    def sort_key(self, request: RequestView) -> tuple[int]:
        return (-request.num_prompt_tokens,)


class OnlyOrder(SchedulingPolicy):
    """A policy that does not read priority (uses_priority stays False)."""

    def sort_key(self, request: RequestView) -> tuple[()]:
        return ()


class PolicyPlugin:
    @hookimpl
    def vframe_register_scheduling_policies(self, register):
        register("longest-first", LongestPromptFirst)
        register("only-order", OnlyOrder)


@pytest.fixture
def policy_plugin() -> Iterator[None]:
    register_plugin(PolicyPlugin(), "test-policies")
    yield
    unregister_plugin("test-policies")


def test_a_third_party_policy_is_selected_by_name(policy_plugin):
    sched = make_scheduler("longest-first", max_num_seqs=1)
    assert isinstance(sched.policy, LongestPromptFirst)
    for rid, num_prompt in [("a", 2), ("b", 9), ("c", 5), ("d", 9)]:
        sched.add_request(request(rid, num_prompt))
    assert admission_order(sched) == ["b", "d", "c", "a"]


def test_the_engine_refuses_priority_under_a_policy_that_ignores_it(policy_plugin):
    from vframe import LLM

    llm = LLM(dtype="float32", num_threads=2, max_model_len=256, scheduling_policy="only-order")
    prompt, params = {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=1)
    with pytest.raises(
        InvalidRequestError,
        match=r"priority=3 needs scheduling_policy='priority' \(the built-in policy that reads priority\) "
        r"or a plugin policy with uses_priority=True; the scheduling policy 'only-order' ignores priority",
    ):
        llm.generate(prompt, params, priority=[3], use_tqdm=False)
    [out] = llm.generate(prompt, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1


class LongestFirstScheduler(DefaultScheduler):
    """A scheduler-policy plugin as written for plugin API 1.0/1.1."""

    def waiting_key(self):
        return lambda r: (-r.num_prompt_tokens, r.arrival_time)


def test_a_1_1_waiting_key_override_still_orders_the_queue_with_a_deprecation_warning():
    config = EngineConfig.from_sources(env={}, max_num_batched_tokens=64, max_num_seqs=1, block_size=4)
    with pytest.warns(DeprecationWarning, match=(
        r"LongestFirstScheduler overrides DefaultScheduler.waiting_key\(\), deprecated since vframe "
        r"plugin API 1.2 and removed in 2.0: register a SchedulingPolicy"
    )):
        sched = LongestFirstScheduler(config, PagedKVCacheManager(16, 4, enable_caching=False))
    for req_id, num_prompt in (("a", 3), ("b", 9), ("c", 5)):
        sched.add_request(request(req_id, num_prompt, arrival_time=float(ord(req_id))))
    assert admission_order(sched) == ["b", "c", "a"]
