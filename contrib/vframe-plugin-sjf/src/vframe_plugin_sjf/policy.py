"""Shortest job first: waiting requests ordered by the work they can cause."""

from __future__ import annotations

from vframe.core.interfaces import RequestView, SchedulingPolicy


class ShortestJobFirst(SchedulingPolicy):
    """Smallest ``prompt tokens + max_tokens`` first, ties by arrival; under memory
    pressure the running request with the most expected work is preempted first."""

    def sort_key(self, request: RequestView) -> tuple[int]:
        return (request.num_prompt_tokens + request.max_tokens,)
