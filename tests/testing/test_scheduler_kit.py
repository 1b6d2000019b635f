"""The scheduler conformance kit (vframe.testing.scheduler) passes vframe's own
scheduler and policies, and fails, naming the step and the request, on schedulers
that break the contract."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from vframe.core.interfaces import RequestView, SchedulingPolicy
from vframe.core.request import Request
from vframe.core.sched.scheduler import DefaultScheduler
from vframe.plugins import get_registry
from vframe.testing.scheduler import check_scheduler, check_scheduling_policy


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_default_scheduler_conforms_with_each_builtin_policy(policy):
    check_scheduling_policy(policy)
    check_scheduler("default", policy=policy, quick=True)


class LongestPromptFirst(SchedulingPolicy):
    def sort_key(self, request: RequestView) -> tuple[int]:
        return (-request.num_prompt_tokens,)


def test_a_policy_class_is_checked_under_a_name_registered_only_meanwhile():
    before = get_registry("scheduling_policy").names()
    check_scheduling_policy(LongestPromptFirst, quick=True)
    assert get_registry("scheduling_policy").names() == before


class OverBudget(DefaultScheduler):
    """Schedules one token more than max_num_batched_tokens allows."""

    def __init__(self, config, kv_cache_manager):
        super().__init__(config, kv_cache_manager)
        self.token_budget += 1


def test_a_scheduler_over_the_token_budget_fails():
    with pytest.raises(
        AssertionError,
        match=r"\[preemption\] step \d+: 9 tokens scheduled \{.*\}, more than the token budget "
        r"max_num_batched_tokens=8",
    ):
        check_scheduler(OverBudget, quick=True)


class NeverAdmitsLongPrompts(DefaultScheduler):
    """Accepts requests of more than 12 prompt tokens but never queues them."""

    def add_request(self, request: Request) -> None:
        if request.num_prompt_tokens > 12:
            self.requests[request.request_id] = request
        else:
            super().add_request(request)


def test_a_scheduler_that_starves_a_request_fails():
    with pytest.raises(
        AssertionError,
        match=r"\[preemption\] after \d+ steps .* requests are unfinished: 'r\d+' \(arrived at step \d+, "
        r"1[3-9] prompt tokens, max_tokens=\d, never scheduled\).*every waiting request must eventually "
        r"be admitted",
    ):
        check_scheduler(NeverAdmitsLongPrompts, quick=True)


class KeepsBlocksOnAbort(DefaultScheduler):
    """Forgets to give an aborted request's blocks back."""

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        self.kv_cache_manager.free = lambda request: None
        try:
            return super().abort_requests(request_ids)
        finally:
            del self.kv_cache_manager.free


def test_a_scheduler_that_keeps_the_blocks_of_aborted_requests_fails():
    with pytest.raises(
        AssertionError, match=r"\[preemption\] step \d+: aborted request 'r\d+' still holds KV blocks \[\d"
    ):
        check_scheduler(KeepsBlocksOnAbort, quick=True)


class IntKey(SchedulingPolicy):
    def sort_key(self, request: RequestView) -> int:  # type: ignore[override]
        return request.num_prompt_tokens


def test_a_policy_whose_key_is_not_a_tuple_fails():
    with pytest.raises(AssertionError, match=r"sort_key\('r0'\) returned int \d+; it must return a tuple"):
        check_scheduling_policy(IntKey, quick=True)
