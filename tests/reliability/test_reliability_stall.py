"""Stall probe: while hostile requests run — a prompt just under the body limit, a
pathological regex in a JSON schema, a client chat template of nested loops —
``/health`` answers within 1 s every time (polled every 100 ms) and a normal
stream keeps getting tokens (no gap over 2 s). The hostile requests themselves
must end in a 4xx. Each kind gets its own server: one that stalls may keep a
core busy long after the probe."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from openai_server import start_server, stop_server
from reliability_harness import AUTH, StreamResult, normal_request_problem, stream

pytestmark = pytest.mark.reliability

WINDOW_S = 10.0  # how long the hostile clients keep sending
HOSTILE_CLIENTS = 3
HEALTH_BOUND_S = 1.0
GAP_BOUND_S = 2.0
BODY_LIMIT = 2 * 2**20  # the default --max-request-body-bytes

NESTED_LOOPS = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{{ messages[0]['content'] }}"
)
CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}
HOSTILE = {
    "big-prompt": ((), "/v1/completions", {"prompt": "hello " * ((BODY_LIMIT - 4096) // 6), "max_tokens": 4}),
    "pathological-regex": ((), "/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "p", "schema": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
    }}),
    "nested-loop-chat-template": (
        ("--trust-request-chat-template",), "/v1/chat/completions",
        {**CHAT, "chat_template_kwargs": {"chat_template": NESTED_LOOPS}},
    ),
}
NORMAL_STREAM = {"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_health_and_streams_stay_responsive_under_hostile_requests(tmp_path: Path, kind: str):
    flags, path, body = HOSTILE[kind]
    server = start_server(tmp_path, *flags)
    try:
        window_end = time.monotonic() + WINDOW_S
        hostile: list[tuple[int | str, float]] = []  # (status or error, seconds)
        streams: list[tuple[float, StreamResult]] = []  # (sent at, what came back)

        def send_hostile() -> None:
            with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=30) as client:
                while time.monotonic() < window_end:
                    sent = time.monotonic()
                    try:
                        status: int | str = client.post(path, json=body).status_code
                    except httpx.TransportError as e:
                        status = repr(e)
                    hostile.append((status, time.monotonic() - sent))

        def stream_normally() -> None:
            with httpx.Client(base_url=server.base_url) as client:
                while time.monotonic() < window_end:
                    streams.append((time.monotonic(), stream(client, "/v1/completions", NORMAL_STREAM, timeout_s=60)))

        threads = [threading.Thread(target=stream_normally, daemon=True)]
        threads += [threading.Thread(target=send_hostile, daemon=True) for _ in range(HOSTILE_CLIENTS)]
        for thread in threads:
            thread.start()
        health: list[float] = []
        deadline = window_end + 45  # the hostile requests sent last may take their 30 s
        while time.monotonic() < deadline and (time.monotonic() < window_end or any(t.is_alive() for t in threads)):
            sent = time.monotonic()
            try:
                ok = httpx.get(server.base_url + "/health", timeout=5).status_code == 200
            except httpx.TransportError:
                ok = False
            health.append(time.monotonic() - sent if ok else float("inf"))
            time.sleep(max(0.0, 0.1 - (time.monotonic() - sent)))
        for thread in threads:
            thread.join(5)

        gaps = [b - a for sent, r in streams for a, b in zip([sent, *r.chunk_times], r.chunk_times)]
        assert [t.name for t in threads if t.is_alive()] == [], "clients still waiting after the probe"
        assert len(health) >= WINDOW_S / 0.2
        assert max(health) < HEALTH_BOUND_S, f"/health took {max(health):.2f} s (of {len(health)} probes)"
        assert [r.well_formed_problem() for _, r in streams] == [None] * len(streams)
        assert max(gaps) < GAP_BOUND_S, f"a normal stream waited {max(gaps):.2f} s for a token"
        assert hostile and all(isinstance(s, int) and 400 <= s < 500 for s, _ in hostile), hostile[:10]
        assert normal_request_problem(server) is None
    finally:
        stop_server(server.process, timeout_s=10)
