"""Conformance checks for schedulers and scheduling policies (plugin API 1.2).

A plugin author calls them from their own tests; a failure raises
``AssertionError`` naming the workload, the step and the request::

    from vframe.testing.scheduler import check_scheduler, check_scheduling_policy

    def test_my_policy_conforms():
        check_scheduling_policy("my-policy")  # its registry name, or the class

    def test_my_scheduler_conforms():
        check_scheduler(MyScheduler, policy="priority")

No model runs. The scheduler is driven with vframe's own KV cache manager
(registry name ``default``, blocks of 4 tokens) through synthetic workloads:
requests of 1 to 20 prompt tokens and 1 to 8 output tokens arriving over the
first steps, a cache of 10 to 16 blocks so that running requests must be
preempted, a token budget of 8 so that prompts are prefilled in chunks, prefix
caching over shared prompt prefixes, swap preemption, whole-prompt prefill, and
aborts of running, waiting, finished and unknown requests. A request that reaches the end
of its known tokens in a step "samples" a deterministic token id.

Checked after every step:

* at most ``max_num_batched_tokens`` tokens and ``max_num_seqs`` requests run;
* no request runs past its known tokens (prompt and sampled), and its KV blocks
  have a slot for every token it runs;
* each scheduled request is described to the runner once: as new, with all its
  tokens, or as cached, only while the runner holds its state and from where it
  stopped;
* every sampled token is reported, once; a request that reached its
  ``max_tokens`` is reported finished with reason ``length``, exactly once, and
  never reported again;
* the free KV blocks are exactly those no unfinished request holds; aborted and
  finished requests hold none;
* every request finishes within a bound on steps (the last arrival plus 4 steps
  per token of the whole workload): no waiting request is left behind forever.

At the end every KV block and swap block is free, and the runner has been told
(``SchedulerOutput.finished_req_ids``) to drop every request it held.

``check_scheduling_policy`` also checks that ``sort_key`` returns a tuple and
that, with one seat and room for everyone, requests are admitted in order of
``(sort_key(request), arrival)``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from vframe.core.config import EngineConfig
from vframe.core.interfaces import KVCacheManager, Scheduler, SchedulingPolicy
from vframe.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from vframe.core.request import Request
from vframe.core.sampling_params import SamplingParams
from vframe.plugins import RegisterFn, get_registry, hookimpl, register_plugin, unregister_plugin

BLOCK_SIZE = 4
STEPS_PER_TOKEN = 4  # the step bound: recompute preemption may compute a token more than once


@dataclass(frozen=True)
class _RequestSpec:
    """One request of a workload; ``arrival_time`` grows in the order requests are added."""

    request_id: str
    arrival_step: int
    arrival_time: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    priority: int = 0

    def make_request(self) -> Request:
        params = SamplingParams(max_tokens=self.max_tokens, ignore_eos=True)
        return Request(
            self.request_id, list(self.prompt_token_ids), params, self.arrival_time, self.priority
        )


@dataclass(frozen=True)
class _Workload:
    """Requests arriving over steps, and the cache and scheduler settings to run them under."""

    name: str
    requests: tuple[_RequestSpec, ...]
    num_blocks: int
    token_budget: int
    max_num_seqs: int
    enable_caching: bool = False
    enable_chunked_prefill: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    num_swap_blocks: int = 0
    aborts: bool = True  # at every 4th step while requests arrive, from step 3

    @property
    def abort_steps(self) -> range:
        return range(3, self.requests[-1].arrival_step + 3, 4) if self.aborts else range(0)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) + r.max_tokens for r in self.requests)

    @property
    def max_steps(self) -> int:
        return self.requests[-1].arrival_step + STEPS_PER_TOKEN * self.num_tokens


# --------------------------------------------------------------------------- #
# Public checks
# --------------------------------------------------------------------------- #


def check_scheduler(
    scheduler: str | type[Scheduler] = "default",
    *,
    policy: str | type[SchedulingPolicy] = "fcfs",
    quick: bool = False,
) -> None:
    """Run the workloads through ``scheduler`` (a registry name or the class),
    configured with ``scheduling_policy=policy`` (a registry name or the class);
    requests carry priorities 0..2 when the policy ``uses_priority``.
    ``quick``: one workload of 10 requests instead of four of 16 to 24."""
    with _policy_name(policy) as policy_name:
        uses_priority = get_registry("scheduling_policy").load(policy_name).uses_priority
        for workload in _workloads(quick=quick, uses_priority=uses_priority):
            _Driver(workload, scheduler, policy_name).run()


def check_scheduling_policy(policy: str | type[SchedulingPolicy], *, quick: bool = False) -> None:
    """Check that ``policy`` (a registry name or the class) gives tuple keys and that
    the default scheduler admits requests in its ``sort_key`` order, ties by arrival,
    then ``check_scheduler`` with the default scheduler and ``policy``."""
    with _policy_name(policy) as policy_name:
        policy_cls = get_registry("scheduling_policy").load(policy_name)
        assert isinstance(policy_cls.uses_priority, bool), (
            f"scheduling policy {policy_name!r}: uses_priority must be True or False, "
            f"got {policy_cls.uses_priority!r}"
        )
        _check_admission_order(policy_name, policy_cls)
        check_scheduler("default", policy=policy_name, quick=quick)


# --------------------------------------------------------------------------- #
# Workloads
# --------------------------------------------------------------------------- #


def _workloads(*, quick: bool, uses_priority: bool) -> list[_Workload]:
    def requests(seed: int, num_requests: int, shared_prefixes: bool = False) -> tuple[_RequestSpec, ...]:
        return _requests(random.Random(seed), num_requests, uses_priority, shared_prefixes=shared_prefixes)

    if quick:
        return [_Workload("preemption", requests(0, 10), num_blocks=10, token_budget=8, max_num_seqs=4)]
    return [
        _Workload("preemption", requests(0, 24), num_blocks=10, token_budget=8, max_num_seqs=4),
        _Workload(
            "prefix caching", requests(1, 16, shared_prefixes=True), num_blocks=16, token_budget=8,
            max_num_seqs=4, enable_caching=True,
        ),
        _Workload(
            "swap preemption", requests(2, 16, shared_prefixes=True), num_blocks=10, token_budget=8,
            max_num_seqs=4, enable_caching=True, preemption_mode="swap", num_swap_blocks=8,
        ),
        # Without chunking the engine makes the budget at least max_model_len, here 20 + 8:
        # a preempted request is recomputed in one step, prompt and output together.
        _Workload(
            "whole prompts", requests(3, 16), num_blocks=12, token_budget=28, max_num_seqs=3,
            enable_chunked_prefill=False,
        ),
    ]


def _requests(
    rng: random.Random, num_requests: int, uses_priority: bool, *, shared_prefixes: bool = False
) -> tuple[_RequestSpec, ...]:
    """Prompts of 1..20 tokens (two blocks of a shared prefix plus up to 12 of
    their own when ``shared_prefixes``), 1..8 output tokens, arrivals over the
    first ``num_requests // 2`` steps."""
    prefixes = [tuple(range(500, 508)), tuple(range(600, 608))]
    arrival_steps = sorted(rng.randint(0, num_requests // 2) for _ in range(num_requests))
    specs = []
    for i, step in enumerate(arrival_steps):
        if shared_prefixes:
            own = tuple(range(1000 * (i + 1), 1000 * (i + 1) + rng.randint(1, 12)))
            prompt = rng.choice(prefixes) + own
        else:
            prompt = tuple(range(1000 * (i + 1), 1000 * (i + 1) + rng.randint(1, 20)))
        priority = rng.randint(0, 2) if uses_priority else 0
        specs.append(_RequestSpec(f"r{i}", step, float(i), prompt, rng.randint(1, 8), priority))
    return tuple(specs)


def _check_admission_order(policy_name: str, policy_cls: type[SchedulingPolicy]) -> None:
    """One seat, room and budget for any request, everyone waiting from step 0:
    nothing but the policy decides who goes next."""
    rng = random.Random(4)
    specs = tuple(
        _RequestSpec(
            f"r{i}", 0, float(i), tuple(range(1000 * (i + 1), 1000 * (i + 1) + rng.randint(1, 6))),
            rng.randint(1, 4), rng.randint(0, 2) if policy_cls.uses_priority else 0,
        )
        for i in range(12)
    )
    workload = _Workload(
        "admission order", specs, num_blocks=16, token_budget=32, max_num_seqs=1, aborts=False
    )
    driver = _Driver(workload, "default", policy_name)
    policy = policy_cls(driver.config)
    keys = {}
    for spec in specs:
        key = policy.sort_key(spec.make_request())
        assert isinstance(key, tuple), (
            f"scheduling policy {policy_name!r}: sort_key({spec.request_id!r}) returned "
            f"{type(key).__name__} {key!r}; it must return a tuple"
        )
        keys[spec.request_id] = key
    driver.run()
    expected = [s.request_id for s in sorted(specs, key=lambda s: (keys[s.request_id], s.arrival_time))]
    assert driver.admission_order == expected, (
        f"[admission order] scheduling policy {policy_name!r}: requests were admitted in order "
        f"{driver.admission_order}, but by (sort_key, arrival) the order is {expected}; "
        f"keys: {', '.join(f'{r}={keys[r]}' for r in expected)}"
    )


@contextmanager
def _policy_name(policy: str | type[SchedulingPolicy]) -> Iterator[str]:
    """The registry name of ``policy``; a class is registered for the duration by a
    throwaway plugin, since the scheduler finds its policy by name."""
    if isinstance(policy, str):
        get_registry("scheduling_policy").get(policy)  # PluginError listing the known names
        yield policy
        return
    name = f"vframe.testing:{policy.__module__}.{policy.__qualname__}"

    class _OnePolicy:
        @hookimpl
        def vframe_register_scheduling_policies(self, register: RegisterFn) -> None:
            register(name, policy)

    register_plugin(_OnePolicy(), name)
    try:
        yield name
    finally:
        unregister_plugin(name)


# --------------------------------------------------------------------------- #
# The driver: a stand-in for the engine and the model runner
# --------------------------------------------------------------------------- #


class _Driver:
    """Runs one workload through one scheduler, checking every step."""

    def __init__(self, workload: _Workload, scheduler: str | type[Scheduler], policy_name: str) -> None:
        self.workload = workload
        scheduler_name = scheduler if isinstance(scheduler, str) else "default"
        self.config = EngineConfig.from_sources(
            env={},
            scheduler=scheduler_name,
            scheduling_policy=policy_name,
            block_size=BLOCK_SIZE,
            enable_prefix_caching=workload.enable_caching,
            max_num_batched_tokens=workload.token_budget,
            max_num_seqs=workload.max_num_seqs,
            enable_chunked_prefill=workload.enable_chunked_prefill,
            preemption_mode=workload.preemption_mode,
        )
        kv_cls = get_registry("kv_cache_manager").load("default")
        self.kv: KVCacheManager = kv_cls(
            workload.num_blocks, BLOCK_SIZE, workload.enable_caching, num_swap_blocks=workload.num_swap_blocks
        )
        sched_cls = get_registry("scheduler").load(scheduler) if isinstance(scheduler, str) else scheduler
        self.scheduler: Scheduler = sched_cls(self.config, self.kv)
        self.specs = {s.request_id: s for s in workload.requests}
        self.step = 0
        self.tokens: dict[str, list[int]] = {}  # unfinished requests: prompt + sampled tokens
        self.runner: dict[str, int] = {}  # requests the runner holds -> their num_computed_tokens
        self.finished_at: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.admission_order: list[str] = []  # first time each request was scheduled

    @property
    def where(self) -> str:
        return f"[{self.workload.name}] step {self.step}"

    def run(self) -> None:
        pending = list(self.workload.requests)
        while pending or self.tokens:
            if self.step > self.workload.max_steps:
                self._fail_starved()
            while pending and pending[0].arrival_step <= self.step:
                spec = pending.pop(0)
                self.scheduler.add_request(spec.make_request())
                self.tokens[spec.request_id] = list(spec.prompt_token_ids)
            if self.step in self.workload.abort_steps:
                self._abort(self._abort_targets())
            self._step()
            self.step += 1
        self._check_drained()

    def _step(self) -> None:
        out = self.scheduler.schedule()
        self._check_schedule(out)
        sampled = {
            rid: len(self.tokens[rid])  # the token id is its position: deterministic
            for rid in out.num_scheduled_tokens
            if self.runner[rid] == len(self.tokens[rid])
        }
        runner_output = ModelRunnerOutput(list(out.num_scheduled_tokens), sampled)
        self._check_outputs(self.scheduler.update_from_output(out, runner_output), sampled)
        self._check_blocks()

    def _abort_targets(self) -> list[str]:
        """The request holding the most blocks (running), the latest arrival holding
        none (waiting), the first that finished, and an id never added."""
        holders = [r for r in self.tokens if self.kv.get_block_ids(r)]
        idle = [r for r in self.tokens if not self.kv.get_block_ids(r)]
        targets = ["never-added"]
        if holders:
            targets.append(max(holders, key=lambda r: len(self.kv.get_block_ids(r))))
        if idle:
            targets.append(idle[-1])
        if self.finished_at:
            targets.append(next(iter(self.finished_at)))
        return targets

    def _abort(self, request_ids: list[str]) -> None:
        unfinished = sorted(r for r in request_ids if r in self.tokens)
        aborted = sorted(r.request_id for r in self.scheduler.abort_requests(request_ids))
        assert aborted == unfinished, (
            f"{self.where}: abort_requests({request_ids}) returned {aborted}; "
            f"expected the unfinished ones among them: {unfinished}"
        )
        for rid in aborted:
            del self.tokens[rid]
            self.aborted.add(rid)
            blocks = self.kv.get_block_ids(rid)
            assert not blocks, f"{self.where}: aborted request {rid!r} still holds KV blocks {blocks}"
        self._check_blocks()

    # ------------------------------------------------------------------ #

    def _check_schedule(self, out: SchedulerOutput) -> None:
        scheduled = out.num_scheduled_tokens
        total = sum(scheduled.values())
        budget, max_num_seqs = self.workload.token_budget, self.workload.max_num_seqs
        assert total <= budget, (
            f"{self.where}: {total} tokens scheduled {scheduled}, more than the token budget "
            f"max_num_batched_tokens={budget}"
        )
        assert out.total_num_scheduled_tokens == total, (
            f"{self.where}: total_num_scheduled_tokens={out.total_num_scheduled_tokens}, but "
            f"num_scheduled_tokens adds up to {total}"
        )
        assert len(scheduled) <= max_num_seqs, (
            f"{self.where}: {len(scheduled)} requests scheduled {sorted(scheduled)}, more than "
            f"max_num_seqs={max_num_seqs}"
        )
        for rid in out.finished_req_ids:
            assert rid not in self.tokens, (
                f"{self.where}: finished_req_ids tells the runner to drop {rid!r}, which has not finished"
            )
            self.runner.pop(rid, None)
        for rid in out.preempted_req_ids:
            self.runner.pop(rid, None)
        new = {d.req_id: d for d in out.scheduled_new_reqs}
        cached = {d.req_id: d for d in out.scheduled_cached_reqs}
        described = set(new) | set(cached)
        assert described <= set(scheduled), (
            f"{self.where}: requests {sorted(described - set(scheduled))} are sent to the runner "
            "but have no entry in num_scheduled_tokens"
        )
        for rid, num_new in scheduled.items():
            self._check_scheduled(rid, num_new, new, cached)

    def _check_scheduled(
        self, rid: str, num_new: int, new: dict[str, NewRequestData], cached: dict[str, CachedRequestData]
    ) -> None:
        request = f"{self.where}: request {rid!r}"
        if rid not in self.tokens:
            state = "aborted" if rid in self.aborted else "finished" if rid in self.finished_at else "unknown"
            raise AssertionError(f"{request} is scheduled, but it is {state}")
        assert num_new >= 1, f"{request} is scheduled for {num_new} tokens; leave it out instead"
        assert (rid in new) != (rid in cached), (
            f"{request} must be sent to the runner exactly once per step, in scheduled_new_reqs "
            f"or in scheduled_cached_reqs (new: {rid in new}, cached: {rid in cached})"
        )
        tokens = self.tokens[rid]
        if rid in new:
            assert new[rid].all_token_ids == tokens, (
                f"{request} is sent as new with tokens {new[rid].all_token_ids}; it has {tokens}"
            )
            start = new[rid].num_computed_tokens
        else:
            assert rid in self.runner, (
                f"{request} is sent as cached, but the runner holds no state for it (never sent, "
                "or preempted or finished since): send it as new"
            )
            start = cached[rid].num_computed_tokens
            assert start == self.runner[rid], (
                f"{request} is sent as cached from token {start}; the runner computed up to "
                f"{self.runner[rid]}"
            )
        end = start + num_new
        assert end <= len(tokens), (
            f"{request} is scheduled for tokens {start}..{end - 1}, beyond its {len(tokens)} tokens "
            "(prompt and sampled)"
        )
        slots = len(self.kv.get_block_ids(rid)) * BLOCK_SIZE
        assert slots >= end, f"{request} runs up to token {end}, but its KV blocks hold {slots} tokens"
        self.runner[rid] = end
        if rid not in self.admission_order:
            self.admission_order.append(rid)

    def _check_outputs(self, outputs: list[EngineCoreOutput], sampled: dict[str, int]) -> None:
        reported: set[str] = set()
        for out in outputs:
            rid = out.req_id
            request = f"{self.where}: request {rid!r}"
            assert rid not in reported, f"{request} is reported twice in one step"
            reported.add(rid)
            assert rid not in self.finished_at, (
                f"{request} is reported again after it finished at step {self.finished_at.get(rid)}"
            )
            assert rid not in self.aborted, f"{request} is reported after it was aborted"
            assert rid in self.tokens, f"{request} is reported, but it was never added"
            expected = [sampled[rid]] if rid in sampled else []
            assert out.new_token_ids == expected, (
                f"{request} is reported with tokens {out.new_token_ids}; the runner sampled {expected}"
            )
            self.tokens[rid] += expected
            spec = self.specs[rid]
            num_output = len(self.tokens[rid]) - len(spec.prompt_token_ids)
            if out.finished:
                assert out.finish_reason == FinishReason.LENGTH and num_output == spec.max_tokens, (
                    f"{request} finished ({out.finish_reason}) after {num_output} tokens; it has "
                    f"max_tokens={spec.max_tokens} and no stop token, so it ends with 'length' then"
                )
                del self.tokens[rid]
                self.finished_at[rid] = self.step
                blocks = self.kv.get_block_ids(rid)
                assert not blocks, f"{request} finished but still holds KV blocks {blocks}"
            else:
                assert num_output < spec.max_tokens, (
                    f"{request} generated its max_tokens={spec.max_tokens} tokens but is not "
                    "reported finished"
                )
        missing = sorted(set(sampled) - reported)
        assert not missing, (
            f"{self.where}: the tokens sampled for {missing} are not reported: update_from_output "
            "returns an EngineCoreOutput for every request that sampled one"
        )

    def _check_blocks(self) -> None:
        held = {b for rid in self.tokens for b in self.kv.get_block_ids(rid)}
        expected = self.kv.num_blocks - len(held)
        assert self.kv.num_free_blocks == expected, (
            f"{self.where}: {self.kv.num_free_blocks} of {self.kv.num_blocks} KV blocks are free, but "
            f"unfinished requests hold {len(held)}, so {expected} should be: blocks were lost or freed twice"
        )
        assert self.scheduler.has_unfinished_requests() == bool(self.tokens), (
            f"{self.where}: has_unfinished_requests() is {not self.tokens} with "
            f"{len(self.tokens)} requests unfinished"
        )
        assert self.scheduler.get_num_unfinished_requests() == len(self.tokens), (
            f"{self.where}: get_num_unfinished_requests() is "
            f"{self.scheduler.get_num_unfinished_requests()}, but {len(self.tokens)} requests are unfinished"
        )

    def _check_drained(self) -> None:
        out = self.scheduler.schedule()
        assert not out.num_scheduled_tokens, (
            f"{self.where}: every request has ended, yet {out.num_scheduled_tokens} is scheduled"
        )
        for rid in out.finished_req_ids:
            self.runner.pop(rid, None)
        assert not self.runner, (
            f"[{self.workload.name}] every request has ended, but the runner was never told to drop "
            f"{sorted(self.runner)} (SchedulerOutput.finished_req_ids)"
        )
        assert self.kv.num_free_blocks == self.kv.num_blocks, (
            f"[{self.workload.name}] every request has ended, but only {self.kv.num_free_blocks} of "
            f"{self.kv.num_blocks} KV blocks are free"
        )
        swap_usage = self.kv.get_stats().get("swap_space_usage", 0.0)
        assert swap_usage == 0.0, (
            f"[{self.workload.name}] every request has ended, but {swap_usage:.0%} of the swap "
            "space is in use"
        )

    def _fail_starved(self) -> None:
        unfinished = []
        for rid in self.tokens:
            spec = self.specs[rid]
            state = "never scheduled" if rid not in self.admission_order else "admitted"
            unfinished.append(
                f"{rid!r} (arrived at step {spec.arrival_step}, {len(spec.prompt_token_ids)} prompt "
                f"tokens, max_tokens={spec.max_tokens}, {state})"
            )
        raise AssertionError(
            f"[{self.workload.name}] after {self.workload.max_steps} steps (the last arrival plus "
            f"{STEPS_PER_TOKEN} per token of the workload) requests are unfinished: "
            f"{', '.join(unfinished)}; every waiting request must eventually be admitted"
        )
