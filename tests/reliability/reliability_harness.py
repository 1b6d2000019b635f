"""Shared pieces of the reliability suite: a server started with the test plugin,
raw-HTTP helpers (SSE parsing, OpenAI's error shape), resource snapshots.

Servers come from ``tests/entrypoints/openai/openai_server.py`` (same flags, same
API key); ``start_launched_server`` runs the CLI through ``reliability_launcher.py``,
which registers ``reliability_plugin`` first.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from openai_server import API_KEY, Server, start_server, stop_server

LAUNCHER = Path(__file__).with_name("reliability_launcher.py")
MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# A request the server must always answer, used after every hostile one.
NORMAL_COMPLETION = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}


def start_launched_server(tmp_path: Path, *extra: str, timeout_s: float = 180.0) -> Server:
    """``vframe serve`` with ``reliability_plugin`` registered, on a free loopback port."""
    return start_server(tmp_path, *extra, timeout_s=timeout_s, entry=[sys.executable, str(LAUNCHER)])


def healthy(server: Server) -> bool:
    try:
        return httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def log_tail(server: Server, chars: int = 2000) -> str:
    return server.log()[-chars:]


def port_of(server: Server) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run_concurrently(jobs: dict[str, Callable[[], object]], timeout_s: float) -> dict[str, object]:
    """Run each job in its own thread; its result, or the exception it raised."""
    results: dict[str, object] = {}

    def run(key: str) -> None:
        try:
            results[key] = jobs[key]()
        except Exception as e:  # noqa: BLE001 - the caller's assertions report it
            results[key] = e

    threads = [threading.Thread(target=run, args=(key,), name=key, daemon=True) for key in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    assert [t.name for t in threads if t.is_alive()] == [], f"still running after {timeout_s} s"
    return results


# --------------------------------------------------------------------------- #
# process resources
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Resources:
    fds: int
    threads: int
    children: tuple[int, ...]

    @classmethod
    def of(cls, pid: int) -> Resources:
        process = psutil.Process(pid)
        return cls(process.num_fds(), process.num_threads(), tuple(c.pid for c in process.children(recursive=True)))


def alive_pids(pids: tuple[int, ...]) -> list[int]:
    return [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


# --------------------------------------------------------------------------- #
# responses
# --------------------------------------------------------------------------- #


def error_shape_problems(response: httpx.Response) -> list[str]:
    """What keeps ``response`` from being OpenAI's error: ``{"error": {"message",
    "type", "param", "code"}}`` with a message and no traceback. Empty = fine."""
    try:
        body = response.json()
    except ValueError:
        return [f"body is not JSON: {response.text[:200]!r}"]
    return error_object_problems(body)


def error_object_problems(body: Any) -> list[str]:
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return [f"not {{'error': {{...}}}}: {str(body)[:200]}"]
    error = body["error"]
    problems = []
    if set(error) != {"message", "type", "param", "code"}:
        problems.append(f"error keys are {sorted(error)}, not ['code', 'message', 'param', 'type']")
    if not isinstance(error.get("message"), str) or not error.get("message"):
        problems.append("error.message is not a non-empty string")
    elif "Traceback" in error["message"]:
        problems.append("error.message holds a traceback")
    if not isinstance(error.get("type"), str):
        problems.append("error.type is not a string")
    for key in ("param", "code"):
        if error.get(key) is not None and not isinstance(error.get(key), str):
            problems.append(f"error.{key} is neither a string nor null")
    return problems


def normal_request_problem(server: Server) -> str | None:
    """None if the server is up and completes a normal request, else why not."""
    if server.process.poll() is not None:
        return f"the server exited with status {server.process.returncode}:\n{log_tail(server)}"
    try:
        response = httpx.post(server.base_url + "/v1/completions", json=NORMAL_COMPLETION, headers=AUTH, timeout=60)
    except httpx.TransportError as e:
        return f"a normal request failed: {e!r}:\n{log_tail(server)}"
    if response.status_code != 200:
        return f"a normal request got {response.status_code}: {response.text[:300]}"
    choices = response.json().get("choices") or [{}]
    if choices[0].get("finish_reason") not in ("stop", "length"):
        return f"a normal request was not completed: {response.text[:300]}"
    return None


def idle_gauges(server: Server, timeout_s: float = 15.0) -> dict[str, float]:
    """KV usage, running and waiting once they reach 0 (or their values at the deadline)."""
    names = ("vframe:kv_cache_usage_perc", "vframe:num_requests_running", "vframe:num_requests_waiting")
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = server.metrics()
        gauges = {name: metrics.get((name, ()), -1.0) for name in names}
        if all(v == 0.0 for v in gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.1)


@dataclass
class StreamResult:
    """What a client saw of one SSE response."""

    status: int = 0
    events: list[dict] = field(default_factory=list)  # every ``data:`` payload but [DONE]
    done: bool = False  # saw ``data: [DONE]``
    transport_error: str | None = None
    body: str = ""  # the body of a non-200 answer
    chunk_times: list[float] = field(default_factory=list)  # monotonic time of each data line

    @property
    def text(self) -> str:
        parts = []
        for event in self.events:
            for choice in event.get("choices") or []:
                parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        return "".join(parts)

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.events for c in e.get("choices") or [] if c.get("finish_reason")]

    @property
    def usage(self) -> dict | None:
        return next((e["usage"] for e in reversed(self.events) if e.get("usage")), None)

    @property
    def errors(self) -> list[dict]:
        return [e for e in self.events if "error" in e]

    def add_line(self, line: str) -> bool:
        """Record one line; True once [DONE] arrived."""
        if not line.startswith("data:"):
            return False
        data = line[len("data:"):].strip()
        self.chunk_times.append(time.monotonic())
        if data == "[DONE]":
            self.done = True
            return True
        self.events.append(json.loads(data))
        return False

    def well_formed_problem(self) -> str | None:
        """None if this is a complete, successful stream."""
        if self.transport_error or self.status != 200:
            return f"status {self.status}, {self.transport_error or self.body[:200]}"
        if not self.done:
            return "no data: [DONE]"
        if self.errors:
            return f"error events: {self.errors}"
        if not self.finish_reasons:
            return "no finish_reason"
        return None


def stream(client: httpx.Client, path: str, body: dict, *, stop_after: int | None = None,
           timeout_s: float = 120.0, result: StreamResult | None = None) -> StreamResult:
    """POST a streaming request and read it; hang up after ``stop_after`` data lines.
    ``result``: fill this one, which another thread may watch while it grows."""
    result = StreamResult() if result is None else result
    deadline = time.monotonic() + timeout_s
    try:
        with client.stream("POST", path, json={**body, "stream": True}, headers=AUTH, timeout=timeout_s) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.body = response.read().decode(errors="replace")
                return result
            for line in response.iter_lines():
                if result.add_line(line) or (stop_after is not None and len(result.chunk_times) >= stop_after):
                    break
                if time.monotonic() > deadline:
                    result.transport_error = f"still streaming after {timeout_s} s"
                    break
    except (httpx.TransportError, json.JSONDecodeError) as e:
        result.transport_error = repr(e)
    return result


async def astream(client: httpx.AsyncClient, path: str, body: dict, *, stop_after: int | None = None) -> StreamResult:
    """``stream`` for asyncio; the client's timeout bounds each read."""
    result = StreamResult()
    try:
        async with client.stream("POST", path, json={**body, "stream": True}, headers=AUTH) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.body = (await response.aread()).decode(errors="replace")
                return result
            async for line in response.aiter_lines():
                if result.add_line(line) or (stop_after is not None and len(result.chunk_times) >= stop_after):
                    break
    except (httpx.TransportError, json.JSONDecodeError) as e:
        result.transport_error = repr(e)
    return result


# --------------------------------------------------------------------------- #
# the shared server
# --------------------------------------------------------------------------- #


class SharedServer:
    """The suite's shared ``vframe serve``. ``get()`` hands out a live server,
    starting a fresh one when a hostile request killed the previous one, so
    that one crash fails one test rather than every test after it."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.server: Server | None = None
        self.starts = 0
        self.baseline: Resources | None = None  # after the first requests of the current process

    def get(self) -> Server:
        if self.server is not None:
            if self.server.process.poll() is None and healthy(self.server):
                return self.server
            stop_server(self.server.process, timeout_s=15)  # dead, or an engine failure is shutting it down
        self.server = start_launched_server(self.tmp_path_factory.mktemp("reliability-serve"))
        self.starts += 1
        if problem := normal_request_problem(self.server):  # warm-up: torch and uvicorn threads exist now
            raise RuntimeError(problem)
        self.baseline = Resources.of(self.server.process.pid)
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            stop_server(self.server.process, timeout_s=15)
