"""``vframe serve --tensor-parallel-size 3``: the OpenAI server on three worker
processes answers as one process does; when a worker is killed, the request in
flight fails with the reason, ``/health`` turns 503 and the server exits with
status 1 (for a supervisor to restart it), leaving no worker behind."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints" / "openai"))
from openai_server import start_server, stop_server  # noqa: E402
from test_tensor_parallel import worker_pids  # noqa: E402


@pytest.mark.slow  # four processes load the model: about 20 s (make test keeps the offline killed-worker test)
def test_server_on_three_ranks_and_a_killed_worker(tmp_path: Path, llm_fp32) -> None:
    server = start_server(tmp_path, "--tensor-parallel-size", "3")
    try:
        workers = worker_pids(server.process.pid)
        assert len(workers) == 3
        client = server.client()
        reply = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                          max_tokens=8, temperature=0)
        expected = llm_fp32.generate("The capital of France is", _greedy(8), use_tqdm=False)[0].outputs[0].text
        assert reply.choices[0].text == expected

        in_flight: dict[str, httpx.Response] = {}
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 400,
                "temperature": 0, "ignore_eos": True}
        request = threading.Thread(target=lambda: in_flight.setdefault("r", server.post("/v1/completions", json=body)))
        request.start()
        time.sleep(1.0)  # the request is generating
        os.kill(workers[1], signal.SIGKILL)
        request.join(30)
        response = in_flight["r"]
        assert response.status_code >= 500
        assert "was killed by signal SIGKILL" in response.text

        # Then the server exits with status 1 for a supervisor to restart it (docs/serving.md);
        # until it is gone, /health answers 503 with the reason.
        try:
            health = httpx.get(server.base_url + "/health", timeout=10)
        except httpx.TransportError:
            health = None  # already gone
        if health is not None:
            assert health.status_code == 503
            assert "the engine is not running" in health.json()["error"]["message"]
            assert "was killed by signal SIGKILL" in health.json()["error"]["message"]
        assert server.process.wait(30) == 1
        assert "was killed by signal SIGKILL" in server.log()
    finally:
        stop_server(server.process)
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in workers if os.path.exists(f"/proc/{pid}")] == []


def _greedy(max_tokens: int):
    from vframe import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens)
