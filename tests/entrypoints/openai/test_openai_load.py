"""A bounded load test: 200 requests from 32 concurrent clients all complete with
the outputs they get alone, none is lost, and the KV cache is empty at the end."""

from __future__ import annotations

import asyncio

import pytest
from openai_server import Server

MODEL = "SmolLM2-135M-Instruct"
NUM_REQUESTS = 200
CONCURRENCY = 32
PROMPTS = [
    f"{subject} is"
    for subject in (
        "The capital of France", "The capital of Japan", "The largest planet", "Water", "The sun",
        "A cat", "The best programming language", "My favourite food", "The ocean", "Music",
        "The moon", "Mount Everest", "A good book", "The weather today", "Coffee",
        "The internet", "A computer", "The color of the sky", "Winter", "Friendship",
    )
]


@pytest.mark.slow  # about 30 s; make test-reliability's load test (512 requests at 64) is the larger one
def test_200_requests_at_concurrency_32(server: Server):
    with server.client() as client:
        reference = [
            client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
            for p in PROMPTS
        ]
    before = server.metrics()

    async def run() -> list[tuple[int, str, int]]:
        semaphore = asyncio.Semaphore(CONCURRENCY)
        async with server.async_client(timeout=120) as client:

            async def one(i: int) -> tuple[int, str, int]:
                kwargs = dict(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=8, temperature=0)
                async with semaphore:
                    if i % 2:  # half of the clients stream
                        stream = await client.completions.create(
                            **kwargs, stream=True, stream_options={"include_usage": True}
                        )
                        text, tokens = "", 0
                        async for chunk in stream:
                            text += "".join(c.text for c in chunk.choices)
                            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
                        return i, text, tokens
                    out = await client.completions.create(**kwargs)
                    return i, out.choices[0].text, out.usage.completion_tokens

            return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))

    results = asyncio.run(run())

    assert sorted(i for i, _, _ in results) == list(range(NUM_REQUESTS))
    wrong = [(i, text) for i, text, _ in results if text != reference[i % len(PROMPTS)]]
    assert wrong == []
    generated = sum(tokens for _, _, tokens in results)
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("vframe:http_requests_total", endpoint="/v1/completions", status="200") == NUM_REQUESTS
    finished = sum(delta("vframe:requests_finished_total", finished_reason=r) for r in ("stop", "length", "abort"))
    assert finished == NUM_REQUESTS
    assert delta("vframe:requests_finished_total", finished_reason="abort") == 0
    assert delta("vframe:generation_tokens_total") == generated
    assert after[("vframe:kv_cache_usage_perc", ())] == 0.0
    assert after[("vframe:num_requests_running", ())] == 0.0
    assert after[("vframe:num_requests_waiting", ())] == 0.0
