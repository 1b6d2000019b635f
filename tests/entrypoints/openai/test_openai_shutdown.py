"""SIGTERM: stop accepting, let in-flight requests finish (or abort them after
--shutdown-timeout, with a complete response), exit 0."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai_server import start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"


def stream_in_background(client: openai.OpenAI, max_tokens: int) -> tuple[threading.Event, dict]:
    """Stream a completion in a thread; returns (first chunk seen, result)."""
    first_chunk = threading.Event()
    result: dict = {"text": "", "finish_reason": None, "error": None}

    def run() -> None:
        try:
            stream = client.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                first_chunk.set()
                for choice in chunk.choices:
                    result["text"] += choice.text
                    result["finish_reason"] = choice.finish_reason or result["finish_reason"]
                if chunk.usage is not None:
                    result["usage"] = chunk.usage
        except Exception as e:  # reported through result
            result["error"] = e
        finally:
            first_chunk.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    result["thread"] = thread
    return first_chunk, result


def test_sigterm_finishes_in_flight_requests_refuses_new_ones_and_exits_0(tmp_path: Path):
    server = start_server(tmp_path, api_key=None)
    try:
        with openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0) as client:
            first_chunk, result = stream_in_background(client, max_tokens=80)
            assert first_chunk.wait(60)
            server.process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # no longer accepting
                httpx.get(server.base_url + "/health", timeout=5)
            result["thread"].join(60)
        assert server.process.wait(timeout=60) == 0
        assert result["error"] is None
        assert result["finish_reason"] == "length"
        assert result["usage"].completion_tokens == 80
        assert "draining 1 request(s) in flight" in server.log()
    finally:
        stop_server(server.process)


def test_sigterm_aborts_what_outlives_the_shutdown_timeout(tmp_path: Path):
    server = start_server(tmp_path, "--shutdown-timeout", "1", api_key=None)
    try:
        with openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0) as client:
            first_chunk, result = stream_in_background(client, max_tokens=480)
            assert first_chunk.wait(60)
            started = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(timeout=30) == 0
            assert time.monotonic() - started < 10
            result["thread"].join(10)
        assert result["error"] is None
        assert result["finish_reason"] == "abort"  # the client got a complete response, marked aborted
        assert 0 < result["usage"].completion_tokens < 480
        assert "aborted 1 request(s) still in flight after 1 s" in server.log()
    finally:
        stop_server(server.process)
