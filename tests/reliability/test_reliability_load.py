"""Load: 512 short requests from 64 concurrent clients (completions and chat,
streamed and not) all get a complete, well-formed answer with the tokens they get
alone, and afterwards the KV cache is empty and nothing runs or waits."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai_server import Server
from reliability_harness import AUTH, astream, idle_gauges

pytestmark = pytest.mark.reliability

NUM_REQUESTS = 512
CONCURRENCY = 64
MAX_TOKENS = 6
TIME_LIMIT_S = 300
PROMPTS = [
    "The capital of France is", "The capital of Japan is", "The largest planet is", "Water is",
    "The sun is", "A cat is", "My favourite food is", "The ocean is", "Music is", "The moon is",
    "Mount Everest is", "A good book is", "Coffee is", "The internet is", "Winter is", "Friendship is",
]
KINDS = ("completion", "completion-stream", "chat", "chat-stream")


def request(kind: str, prompt: str) -> tuple[str, dict]:
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0}
    if kind.startswith("chat"):
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **sampling}
    return "/v1/completions", {"prompt": prompt, **sampling}


def answer_text(response: httpx.Response) -> tuple[str | None, str | None]:
    """(text, None) for a complete answer, (None, why) otherwise."""
    if response.status_code != 200:
        return None, f"status {response.status_code}: {response.text[:200]}"
    body = response.json()
    choice = (body.get("choices") or [{}])[0]
    if choice.get("finish_reason") not in ("stop", "length") or not body.get("usage"):
        return None, f"incomplete: {str(body)[:200]}"
    return choice.get("text", (choice.get("message") or {}).get("content")), None


async def one(client: httpx.AsyncClient, kind: str, prompt: str) -> tuple[str | None, str | None]:
    path, body = request(kind, prompt)
    try:
        if kind.endswith("stream"):
            result = await astream(client, path, {**body, "stream_options": {"include_usage": True}})
            problem = result.well_formed_problem() or (None if result.usage else "no usage chunk")
            return (None, problem) if problem else (result.text, None)
        return answer_text(await client.post(path, json=body, headers=AUTH))
    except httpx.TransportError as e:
        return None, repr(e)


def test_512_requests_at_concurrency_64_lose_nothing(server: Server):
    before = server.metrics()

    async def run() -> tuple[dict, list]:
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=120) as client:
            reference = {}
            for kind in ("completion", "chat"):
                for prompt in PROMPTS:
                    text, problem = await one(client, kind, prompt)
                    assert problem is None, problem
                    reference[kind, prompt] = text
            semaphore = asyncio.Semaphore(CONCURRENCY)

            async def bounded(i: int) -> tuple[int, str | None, str | None]:
                async with semaphore:
                    return i, *await one(client, KINDS[i % len(KINDS)], PROMPTS[i % len(PROMPTS)])

            jobs = asyncio.gather(*(bounded(i) for i in range(NUM_REQUESTS)))
            return reference, await asyncio.wait_for(jobs, TIME_LIMIT_S)

    reference, results = asyncio.run(run())

    lost = [(i, problem) for i, _, problem in results if problem is not None]
    assert lost == []
    wrong = [
        (i, text) for i, text, _ in results
        if text != reference[KINDS[i % len(KINDS)].removesuffix("-stream"), PROMPTS[i % len(PROMPTS)]]
    ]
    assert wrong == []
    assert idle_gauges(server) == {
        "vframe:kv_cache_usage_perc": 0.0, "vframe:num_requests_running": 0.0, "vframe:num_requests_waiting": 0.0,
    }
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    finished = {r: delta("vframe:requests_finished_total", finished_reason=r) for r in ("stop", "length", "abort")}
    assert finished["abort"] == 0
    assert finished["stop"] + finished["length"] == NUM_REQUESTS + 2 * len(PROMPTS)
