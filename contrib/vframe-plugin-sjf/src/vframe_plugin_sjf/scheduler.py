"""The default scheduler with waiting requests ordered by expected work."""

from __future__ import annotations

from collections.abc import Callable

from vframe.core.request import Request
from vframe.core.sched.scheduler import DefaultScheduler


def expected_work(request: Request) -> tuple[int, float]:
    """Tokens the request will hold at most: its prompt plus its output cap."""
    return (request.num_prompt_tokens + request.max_tokens, request.arrival_time)


class ShortestJobFirstScheduler(DefaultScheduler):
    def waiting_key(self) -> Callable[[Request], tuple] | None:
        return expected_work
