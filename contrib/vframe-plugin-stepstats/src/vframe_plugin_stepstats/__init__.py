"""vframe plugin: per-step token counts and latencies, per-request latency, as JSON lines.

Active only when ``VFRAME_STEPSTATS_FILE`` names a file (read when an engine's
first event arrives). Records are appended, one JSON object per line, each with
the ``engine_id`` of the engine it describes, so that the engines of one
process can share the file; see README.md for the fields.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, Any

from vframe import hookimpl
from vframe.core.plugin_context import EngineView

VFRAME_PLUGIN_API = "1.2"  # engine_view in the lifecycle hooks
ENV = "VFRAME_STEPSTATS_FILE"


class StepStats:
    """Accumulates one engine's statistics and writes each record to ``path`` as it happens."""

    def __init__(self, path: str | os.PathLike, engine_id: str) -> None:
        self.path = Path(path)
        self.engine_id = engine_id
        self._file: IO[str] = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self.num_steps = 0
        self.num_scheduled_tokens = 0
        self.step_time_s = 0.0
        self.max_step_s = 0.0
        self.num_requests = 0
        self.request_latency_s = 0.0
        self._num_timed_requests = 0
        self._added_at: dict[str, float] = {}  # request_id -> perf_counter() when added

    def request_added(self, request_id: str) -> None:
        self._added_at[request_id] = time.perf_counter()

    def step(self, num_scheduled_tokens: int, elapsed_s: float) -> None:
        self.num_steps += 1
        self.num_scheduled_tokens += num_scheduled_tokens
        self.step_time_s += elapsed_s
        self.max_step_s = max(self.max_step_s, elapsed_s)
        self._write(
            event="step",
            step=self.num_steps,
            num_scheduled_tokens=num_scheduled_tokens,
            elapsed_s=elapsed_s,
        )

    def request_finished(
        self, request_id: str, finish_reason: str, num_prompt_tokens: int, num_output_tokens: int
    ) -> None:
        added_at = self._added_at.pop(request_id, None)
        latency_s = None if added_at is None else time.perf_counter() - added_at
        self.num_requests += 1
        if latency_s is not None:
            self.request_latency_s += latency_s
            self._num_timed_requests += 1
        self._write(
            event="request",
            request_id=request_id,
            finish_reason=getattr(finish_reason, "value", finish_reason),
            num_prompt_tokens=num_prompt_tokens,
            num_output_tokens=num_output_tokens,
            latency_s=latency_s,
        )

    def summary(self) -> dict[str, Any]:
        return {
            "num_steps": self.num_steps,
            "num_scheduled_tokens": self.num_scheduled_tokens,
            "step_time_s": self.step_time_s,
            "mean_step_s": self.step_time_s / self.num_steps if self.num_steps else None,
            "max_step_s": self.max_step_s,
            "tokens_per_s": self.num_scheduled_tokens / self.step_time_s if self.step_time_s else None,
            "num_requests": self.num_requests,
            "mean_request_latency_s": (
                self.request_latency_s / self._num_timed_requests if self._num_timed_requests else None
            ),
        }

    def close(self) -> None:
        self._write(event="summary", **self.summary())
        self._file.close()

    def _write(self, **record: Any) -> None:
        record["engine_id"] = self.engine_id
        record["time"] = time.time()
        self._file.write(json.dumps(record) + "\n")


_recorders: dict[str, StepStats] = {}  # engine_id -> the recorder of that engine


def recorder_for(engine_view: EngineView) -> StepStats | None:
    """The engine's recorder, created on its first event if the environment asks
    for one; ``None`` when ``VFRAME_STEPSTATS_FILE`` is unset."""
    rec = _recorders.get(engine_view.engine_id)
    if rec is None and os.environ.get(ENV):
        rec = _recorders[engine_view.engine_id] = StepStats(os.environ[ENV], engine_view.engine_id)
    return rec


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@hookimpl
def vframe_engine_started(engine_view: EngineView) -> None:
    recorder_for(engine_view)


@hookimpl
def vframe_request_added(request_id: str, engine_view: EngineView) -> None:
    if (rec := recorder_for(engine_view)) is not None:
        rec.request_added(request_id)


@hookimpl
def vframe_engine_step(num_scheduled_tokens: int, elapsed_s: float, engine_view: EngineView) -> None:
    if (rec := recorder_for(engine_view)) is not None:
        rec.step(num_scheduled_tokens, elapsed_s)


@hookimpl
def vframe_request_finished(
    request_id: str, finish_reason: str, num_prompt_tokens: int, num_output_tokens: int, engine_view: EngineView
) -> None:
    if (rec := recorder_for(engine_view)) is not None:
        rec.request_finished(request_id, finish_reason, num_prompt_tokens, num_output_tokens)


@hookimpl
def vframe_engine_shutdown(engine_view: EngineView) -> None:
    rec = _recorders.pop(engine_view.engine_id, None)
    if rec is not None:
        rec.close()
