"""A disconnect storm: 200 clients hang up mid-answer (streams after 3 chunks,
non-streamed requests after 2 s) among normal requests. The normal ones get their
usual text, every dropped one is aborted, the KV cache empties and the server
goes on serving."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai_server import Server
from reliability_harness import AUTH, astream, idle_gauges, normal_request_problem

pytestmark = pytest.mark.reliability

NUM_DROPPED_STREAMS = 176
NUM_DROPPED_WAITS = 24  # non-streamed requests whose client gives up
NUM_NORMAL = 64
CONCURRENCY = 64
TIME_LIMIT_S = 300
LONG = {"max_tokens": 128, "temperature": 0, "ignore_eos": True}
NORMAL = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def dropped_body(i: int) -> tuple[str, dict]:
    if i % 2:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Story number {i}:"}], **LONG}
    return "/v1/completions", {"prompt": f"Story number {i}:", **LONG}


def test_a_disconnect_storm_leaves_nothing_behind(server: Server):
    reference = server.post("/v1/completions", json=NORMAL).json()["choices"][0]["text"]
    aborted_before = server.metric("vframe:requests_finished_total", finished_reason="abort")

    async def run() -> list[tuple[str, str | None]]:
        # A fresh connection per request: many connects and hang-ups, and no keep-alive race.
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=120) as client:
            semaphore = asyncio.Semaphore(CONCURRENCY)

            async def drop_stream(i: int) -> tuple[str, str | None]:
                path, body = dropped_body(i)
                result = await astream(client, path, body, stop_after=3)
                ok = result.status == 200 and len(result.chunk_times) == 3 and not result.done
                return "dropped", None if ok else f"{path}: {result.status} {result.transport_error or result.body}"

            async def drop_wait(i: int) -> tuple[str, str | None]:
                path, body = dropped_body(i)
                try:  # 128 tokens among 64 requests take longer than 2 s on any CPU
                    await asyncio.wait_for(client.post(path, json=body, headers=AUTH), 2.0)
                except asyncio.TimeoutError:
                    return "dropped", None
                return "dropped", "answered within 2 s: too fast to test a drop"

            async def normal() -> tuple[str, str | None]:
                response = await client.post("/v1/completions", json=NORMAL, headers=AUTH)
                if response.status_code != 200:
                    return "normal", f"{response.status_code}: {response.text[:200]}"
                text = response.json()["choices"][0]["text"]
                return "normal", None if text == reference else f"text {text!r} != {reference!r}"

            jobs = [drop_stream(i) for i in range(NUM_DROPPED_STREAMS)]
            jobs += [drop_wait(i) for i in range(NUM_DROPPED_WAITS)]
            jobs += [normal() for _ in range(NUM_NORMAL)]
            jobs = [jobs[i] for i in sorted(range(len(jobs)), key=lambda i: (i * 7919) % len(jobs))]  # interleave

            async def bounded(job):
                async with semaphore:
                    return await job

            return await asyncio.wait_for(asyncio.gather(*(bounded(j) for j in jobs)), TIME_LIMIT_S)

    results = asyncio.run(run())

    assert [r for r in results if r[1] is not None] == []
    assert idle_gauges(server, timeout_s=30) == {
        "vframe:kv_cache_usage_perc": 0.0, "vframe:num_requests_running": 0.0, "vframe:num_requests_waiting": 0.0,
    }
    aborted = server.metric("vframe:requests_finished_total", finished_reason="abort") - aborted_before
    assert aborted == NUM_DROPPED_STREAMS + NUM_DROPPED_WAITS
    assert normal_request_problem(server) is None
    assert server.post("/v1/completions", json=NORMAL).json()["choices"][0]["text"] == reference
