"""A client that goes away aborts its request: its KV blocks are freed at once."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai_server import Server

MODEL = "SmolLM2-135M-Instruct"
LONG = dict(model=MODEL, prompt="Once upon a time", max_tokens=400, temperature=0, extra_body={"ignore_eos": True})


def test_dropped_stream_frees_its_kv_blocks(server: Server, client: openai.OpenAI):
    assert server.wait_for_metric("vframe:kv_cache_usage_perc", 0.0) == 0.0
    aborted_before = server.metric("vframe:requests_finished_total", finished_reason="abort")

    stream = client.completions.create(**LONG, stream=True)
    for _, chunk in zip(range(3), stream):
        assert chunk.choices[0].text
    assert server.metric("vframe:num_requests_running") == 1.0
    assert server.metric("vframe:kv_cache_usage_perc") > 0.0
    stream.close()  # the client hangs up after 3 of 400 tokens

    assert server.wait_for_metric("vframe:kv_cache_usage_perc", 0.0) == 0.0
    assert server.metric("vframe:num_requests_running") == 0.0
    assert server.metric("vframe:requests_finished_total", finished_reason="abort") == aborted_before + 1


def test_dropped_non_streaming_request_frees_its_kv_blocks(server: Server):
    aborted_before = server.metric("vframe:requests_finished_total", finished_reason="abort")
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up before the 400 tokens are done
        server.post("/v1/completions", json=body, timeout=1.0)
    assert server.wait_for_metric("vframe:kv_cache_usage_perc", 0.0) == 0.0
    assert server.metric("vframe:num_requests_running") == 0.0
    assert server.metric("vframe:requests_finished_total", finished_reason="abort") == aborted_before + 1


def test_dropped_chat_stream_with_n_2_aborts_both_sequences(server: Server, client: openai.OpenAI):
    aborted_before = server.metric("vframe:requests_finished_total", finished_reason="abort")
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}], n=2, max_tokens=400,
        temperature=1.0, seed=1, stream=True, extra_body={"ignore_eos": True},
    )
    for _, _chunk in zip(range(6), stream):
        pass
    assert server.metric("vframe:num_requests_running") == 2.0
    stream.close()
    assert server.wait_for_metric("vframe:kv_cache_usage_perc", 0.0) == 0.0
    assert server.metric("vframe:requests_finished_total", finished_reason="abort") == aborted_before + 2
