"""The built-in scheduling policies, registered as ``fcfs`` and ``priority``.

A policy gives each request a sort key; the scheduler admits waiting requests
smallest key first (ties by arrival) and preempts running ones largest key
first (see ``vframe.core.interfaces.SchedulingPolicy``).
"""

from __future__ import annotations

from vframe.core.interfaces import RequestView, SchedulingPolicy


class FirstComeFirstServed(SchedulingPolicy):
    """Every request has the same key: admitted in order of arrival, the latest
    admitted preempted first. A preempted request waits at the front again."""

    def sort_key(self, request: RequestView) -> tuple[()]:
        return ()


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` first, ties by arrival; under memory pressure the
    highest value (the latest among equals) is preempted first."""

    uses_priority = True

    def sort_key(self, request: RequestView) -> tuple[int]:
        return (request.priority,)
