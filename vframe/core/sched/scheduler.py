"""The default scheduler: continuous batching under one token budget.

There are no prefill and decode phases. Each step every request is brought
closer to ``num_tokens``: running requests first (a decode is one token, a
prefill chunk as many as the budget allows), then waiting requests while the
budget, ``max_num_seqs`` and free KV blocks last. With LoRA, the running
requests use at most ``max_loras`` distinct adapters: a waiting request whose
adapter would be one more waits at the head of the queue (admission stops
behind it) until a running adapter's last request finishes.

The order of both queues is the configured ``SchedulingPolicy``'s
(``scheduling_policy``, looked up in the plugin registry): waiting requests are
admitted smallest ``sort_key`` first. When a running request cannot get a block,
the running request with the largest key is preempted and waits again (under
first come, first served: the latest admitted, back at the front of the queue).
With ``preemption_mode="recompute"`` its blocks are freed and its tokens
computed again when readmitted; with ``"swap"`` its blocks are copied to the
swap space and copied back (falling back to recompute when the swap space is full).
"""

from __future__ import annotations

import heapq
import itertools
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from vframe.core.config import EngineConfig
from vframe.core.interfaces import KVCacheManager, Scheduler, SchedulingPolicy
from vframe.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    RequestError,
    SchedulerOutput,
)
from vframe.core.request import Request, RequestStatus
from vframe.core.sched.policies import FirstComeFirstServed
from vframe.errors import ConfigError
from vframe.plugins import get_registry

SortKey = Callable[[Request], tuple]


class WaitingQueue:
    """A FIFO deque, or a heap ordered by ``key(request)``, ties by arrival time
    and then by the order of ``add``."""

    def __init__(self, key: SortKey | None = None) -> None:
        self.key = key
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[tuple, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        if self.key is None:
            self._fifo.append(request)
        else:
            entry = (self.key(request), request.arrival_time, next(self._counter), request)
            heapq.heappush(self._heap, entry)

    def add_front(self, request: Request) -> None:
        """A preempted request keeps its place: first in FIFO order, by key otherwise."""
        if self.key is None:
            self._fifo.appendleft(request)
        else:
            self.add(request)

    def peek(self) -> Request:
        return self._fifo[0] if self.key is None else self._heap[0][-1]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.key is None else heapq.heappop(self._heap)[-1]

    def remove(self, requests: set[Request]) -> None:
        if self.key is None:
            self._fifo = deque(r for r in self._fifo if r not in requests)
        else:
            self._heap = [e for e in self._heap if e[-1] not in requests]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._fifo) if self.key is None else len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._fifo if self.key is None else [e[-1] for e in sorted(self._heap)])


class DefaultScheduler(Scheduler):
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager) -> None:
        super().__init__(config, kv_cache_manager)
        sc = config.scheduler
        self.max_num_seqs = sc.max_num_seqs
        self.token_budget = sc.max_num_batched_tokens  # resolved by the engine
        self.enable_chunked_prefill = sc.enable_chunked_prefill
        self.long_prefill_token_threshold = sc.long_prefill_token_threshold
        # Distinct LoRA adapters among running requests: at most the resident slots.
        self.max_loras = config.lora.max_loras if config.lora.enable_lora else None
        policy_cls = get_registry("scheduling_policy").load(sc.scheduling_policy)
        self.policy: SchedulingPolicy = policy_cls(config)
        self.preemption_mode = sc.preemption_mode
        if self.preemption_mode == "swap" and not kv_cache_manager.num_swap_blocks:
            raise ConfigError(
                "preemption_mode='swap' needs a swap space: set swap_space (GiB) > 0"
            )
        self.requests: dict[str, Request] = {}
        legacy_key = self._legacy_waiting_key()
        self.waiting = WaitingQueue(legacy_key or _waiting_key(self.policy))
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        # Requests the runner has state for; others are sent as new.
        self._runner_known: set[str] = set()
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self._swap_out: list[tuple[int, int]] = []  # copies owed to the runner this step
        self._swap_in: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ #

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = [self.requests[i] for i in request_ids if i in self.requests]
        self._finish(aborted, RequestStatus.FINISHED_ABORTED)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_stats(self) -> dict[str, float]:
        preempted = (RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_preempted": sum(r.status in preempted for r in self.waiting),
            "num_swapped": sum(r.status == RequestStatus.SWAPPED for r in self.waiting),
            "num_preemptions": self.num_preemptions,
            "num_swap_preemptions": self.num_swap_preemptions,
            **self.kv_cache_manager.get_stats(),
        }

    # ------------------------------------------------------------------ #

    def schedule(self) -> SchedulerOutput:
        budget = self.token_budget
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        preempted: list[Request] = []

        # 1. Running requests, in order; preempt from the back when blocks run out.
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            num_new = len(request.all_token_ids) - request.num_computed_tokens
            if num_new != 1:  # a decode (one token, within any budget left) needs no capping
                num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                idx += 1
                continue
            while True:
                blocks = self.kv_cache_manager.allocate_slots(request, num_new)
                if blocks is not None:
                    break
                victim = self._pick_victim()
                if victim.request_id in num_scheduled:  # already scheduled this step
                    budget += num_scheduled.pop(victim.request_id)
                    del new_blocks[victim.request_id]
                if self.running.index(victim) < idx:
                    idx -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if blocks is None:  # preempted itself
                continue
            num_scheduled[request.request_id] = num_new
            new_blocks[request.request_id] = blocks
            budget -= num_new
            idx += 1

        # 2. Waiting requests, while budget, seats and blocks last.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            request = self.waiting.peek()
            if not self._adapter_fits(request):
                # It waits at the head, and so does everyone behind it, until a
                # running adapter's last request finishes: it cannot be starved.
                break
            if request.status == RequestStatus.SWAPPED:
                num_new = self._cap(request.num_tokens - request.num_computed_tokens, budget)
                copies = self.kv_cache_manager.swap_in(request, num_new)
                if copies is None:
                    break
                self._swap_in.extend(copies)
                self._admit(request, num_new, [], num_scheduled, new_blocks)
                budget -= num_new
                continue
            computed_blocks, num_hit = ([], 0)
            if request.num_computed_tokens == 0:
                if self.kv_cache_manager.is_being_computed(request):
                    break  # its prefix is being computed now: a hit next step
                computed_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - request.num_computed_tokens - num_hit
            if not self.enable_chunked_prefill and num_new > budget:
                break
            num_new = self._cap(num_new, budget)
            blocks = self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks, num_hit)
            if blocks is None:
                break
            request.num_computed_tokens += num_hit
            request.num_cached_tokens = max(request.num_cached_tokens, num_hit)
            self._admit(request, num_new, blocks, num_scheduled, new_blocks)
            budget -= num_new

        return self._make_output(num_scheduled, new_blocks, preempted)

    def _admit(
        self,
        request: Request,
        num_new: int,
        blocks: list[int],
        num_scheduled: dict[str, int],
        new_blocks: dict[str, list[int]],
    ) -> None:
        self.waiting.pop()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        num_scheduled[request.request_id] = num_new
        new_blocks[request.request_id] = blocks

    def _adapter_fits(self, request: Request) -> bool:
        """Whether running ``request`` keeps the running requests' distinct LoRA
        adapters within ``max_loras`` (the resident slots of one step)."""
        if self.max_loras is None or request.lora_int_id is None:
            return True
        running = {r.lora_int_id for r in self.running if r.lora_int_id is not None}
        return request.lora_int_id in running or len(running) < self.max_loras

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        num_new = request.num_tokens - request.num_computed_tokens
        if not self.enable_chunked_prefill and num_new > budget:
            return 0
        return self._cap(num_new, budget)

    def _cap(self, num_new: int, budget: int) -> int:
        if 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        return min(num_new, budget)

    def waiting_key(self) -> SortKey | None:
        """Deprecated since plugin API 1.2, removed in 2.0: a scheduling policy is a
        ``SchedulingPolicy`` now. A subclass written for 1.0/1.1 that still
        overrides this gets its key used for both queues, with a ``DeprecationWarning``."""
        return None

    def _legacy_waiting_key(self) -> SortKey | None:
        if type(self).waiting_key is DefaultScheduler.waiting_key:
            return None
        warnings.warn(
            f"{type(self).__name__} overrides DefaultScheduler.waiting_key(), deprecated since "
            "vframe plugin API 1.2 and removed in 2.0: register a SchedulingPolicy and select it "
            "with scheduling_policy=... instead (docs/plugins.md, 'Scheduling policy')",
            DeprecationWarning,
            stacklevel=3,
        )
        return self.waiting_key()

    def _pick_victim(self) -> Request:
        """The request that would be admitted last goes first: the largest key,
        the latest arrival among equal keys (FIFO: the latest admitted)."""
        key = self.waiting.key
        if key is None:
            return self.running[-1]
        return max(self.running, key=lambda r: (key(r), r.arrival_time))

    def _preempt(self, request: Request) -> None:
        """Swap the request out if configured and the swap space has room, else
        free its blocks to recompute it. Either way it waits at the front again."""
        self.running.remove(request)
        copies = None
        if self.preemption_mode == "swap":
            copies = self.kv_cache_manager.swap_out(request)
        if copies is not None:
            self._swap_out.extend(copies)
            request.status = RequestStatus.SWAPPED
            self.num_swap_preemptions += 1
        else:
            self.kv_cache_manager.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._runner_known.discard(request.request_id)  # it is sent again in full
        self.waiting.add_front(request)

    def _make_output(
        self,
        num_scheduled: dict[str, int],
        new_blocks: dict[str, list[int]],
        preempted: list[Request],
    ) -> SchedulerOutput:
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            if req_id in self._runner_known:
                cached_reqs.append(
                    CachedRequestData(req_id, new_blocks[req_id], request.num_computed_tokens)
                )
            else:
                self._runner_known.add(req_id)
                new_reqs.append(
                    NewRequestData(
                        req_id=req_id,
                        prompt_token_ids=request.prompt_token_ids,
                        all_token_ids=list(request.all_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=list(self.kv_cache_manager.get_block_ids(req_id)),
                        num_computed_tokens=request.num_computed_tokens,
                        num_output_tokens=request.num_output_tokens,
                        lora_request=request.lora_request,
                    )
                )
            request.num_computed_tokens += n
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            preempted_req_ids={r.request_id for r in preempted},
            finished_req_ids=self.finished_req_ids,
            blocks_to_swap_out=self._swap_out,
            blocks_to_swap_in=self._swap_in,
        )
        self.finished_req_ids, self._swap_out, self._swap_in = set(), [], []
        return out

    # ------------------------------------------------------------------ #

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        # The step ran: the KV of every scheduled token is written, so full blocks
        # may become prefix-cache hits now (never before, see kv_cache_manager.py).
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        outputs = self.fail_requests(runner_output.failed)
        finished: list[tuple[Request, RequestStatus]] = []
        for req_id in runner_output.stopped:
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                finished.append((request, RequestStatus.FINISHED_STOPPED))
                outputs.append(EngineCoreOutput(req_id, [], finish_reason=FinishReason.STOP))
        # Once per sampled request and step: at 1,024 requests this loop is a few
        # milliseconds of a GPU step, so it reads attributes directly.
        requests, running, all_logprobs = self.requests, RequestStatus.RUNNING, runner_output.logprobs
        for req_id, token_id in runner_output.sampled_token_ids.items():
            request = requests.get(req_id)
            if request is None or request.status != running:
                continue  # aborted, preempted or failed while the step ran
            request.output_token_ids.append(token_id)  # append_output_token_ids, inlined
            request.all_token_ids.append(token_id)
            status = self._check_stop(request, token_id)
            logprobs = all_logprobs.get(req_id) if all_logprobs else None
            out = EngineCoreOutput(
                req_id, [token_id], [logprobs] if logprobs is not None else None,
                num_cached_tokens=request.num_cached_tokens,
            )
            if status is not None:
                finished.append((request, status))
                out.finish_reason = RequestStatus.finish_reason(status)
                out.stop_reason = request.stop_reason
            outputs.append(out)
        for request, status in finished:
            self._finish([request], status)
        return outputs

    def fail_requests(self, errors: dict[str, RequestError]) -> list[EngineCoreOutput]:
        """Finish requests with ``finish_reason="error"`` (``req_id -> why``) and free
        their blocks; the others are untouched. Unknown ids are ignored."""
        outputs = []
        failed = []
        for req_id, error in errors.items():
            request = self.requests.get(req_id)
            if request is None:
                continue
            failed.append(request)
            outputs.append(
                EngineCoreOutput(
                    req_id, [], finish_reason=FinishReason.ERROR, error=error,
                    num_cached_tokens=request.num_cached_tokens,
                )
            )
        self._finish(failed, RequestStatus.FINISHED_ERROR)
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        sp = request.sampling_params
        num_output = len(request.output_token_ids)
        if token_id in sp.all_stop_token_ids and num_output >= sp.min_tokens:
            if token_id in sp.stop_token_ids:
                request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests for reasons found outside the core (a stop string)."""
        self._finish([self.requests[i] for i in request_ids if i in self.requests], status)

    def _finish(self, requests: list[Request], status: RequestStatus) -> None:
        if not requests:
            return
        gone = set(requests)
        self.running = [r for r in self.running if r not in gone]
        self.waiting.remove(gone)
        for request in requests:
            request.status = status
            self.kv_cache_manager.free(request)
            del self.requests[request.request_id]
            if request.request_id in self._runner_known:
                self._runner_known.discard(request.request_id)
                self.finished_req_ids.add(request.request_id)


def _waiting_key(policy: SchedulingPolicy) -> SortKey | None:
    """The waiting queue's key; ``None`` (a plain FIFO) for first come, first served,
    so that a preempted request goes back to the very front even when its arrival
    time ties with, or (given explicitly) comes after, a request still waiting."""
    if type(policy).sort_key is FirstComeFirstServed.sort_key:
        return None
    return policy.sort_key
