"""SIGTERM with 32 streams in flight: every stream ends properly (all its tokens
when the drain has time, ``finish_reason: "abort"`` and ``[DONE]`` when
``--shutdown-timeout`` runs out first), the server exits 0 within the timeout,
leaves no child process, and its port is free again."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest
from openai_server import start_server, stop_server
from reliability_harness import Resources, StreamResult, alive_pids, port_is_free, port_of, run_concurrently, stream

pytestmark = pytest.mark.reliability

NUM_STREAMS = 32


@pytest.mark.parametrize(
    ("shutdown_timeout_s", "max_tokens", "finish_reason"),
    [(60, 48, "length"), (2, 200, "abort")],
    ids=["drain", "abort-after-timeout"],
)
def test_sigterm_ends_every_stream_and_exits_0(tmp_path: Path, shutdown_timeout_s: int, max_tokens: int,
                                                finish_reason: str):
    server = start_server(tmp_path, "--shutdown-timeout", str(shutdown_timeout_s))
    port = port_of(server)
    try:
        children = Resources.of(server.process.pid).children
        limits = httpx.Limits(max_connections=NUM_STREAMS + 4)
        with httpx.Client(base_url=server.base_url, limits=limits) as client:
            body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            started: list[StreamResult] = []

            def one(i: int) -> StreamResult:
                result = StreamResult()
                started.append(result)
                return stream(client, "/v1/completions", {"prompt": f"Story {i}: once upon a time", **body},
                              timeout_s=180, result=result)

            jobs = {f"stream-{i}": (lambda i=i: one(i)) for i in range(NUM_STREAMS)}
            signalled: dict[str, float] = {}

            def sigterm_once_all_stream() -> None:
                deadline = time.monotonic() + 120
                while sum(bool(r.chunk_times) for r in started) < NUM_STREAMS and time.monotonic() < deadline:
                    time.sleep(0.05)
                signalled["at"] = time.monotonic()
                server.process.send_signal(signal.SIGTERM)

            results = run_concurrently({**jobs, "sigterm": sigterm_once_all_stream}, timeout_s=240)
        returncode = server.process.wait(timeout=shutdown_timeout_s + 60)
        exited_after_s = time.monotonic() - signalled["at"]

        streams = [results[key] for key in jobs]
        assert [r.well_formed_problem() for r in streams] == [None] * NUM_STREAMS
        assert [r.finish_reasons for r in streams] == [[finish_reason]] * NUM_STREAMS
        if finish_reason == "length":
            assert [r.usage["completion_tokens"] for r in streams] == [max_tokens] * NUM_STREAMS
        assert returncode == 0, server.log()[-2000:]
        assert exited_after_s < shutdown_timeout_s + 15
        assert alive_pids(children) == []
        assert port_is_free(port)
    finally:
        stop_server(server.process)
