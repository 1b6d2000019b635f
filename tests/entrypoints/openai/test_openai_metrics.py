"""/metrics parses as Prometheus text and its counters match the requests sent."""

from __future__ import annotations

import httpx
import openai
from openai_server import Server
from prometheus_client.parser import text_string_to_metric_families

MODEL = "SmolLM2-135M-Instruct"

FAMILIES = {
    "vframe:http_requests": "counter",
    "vframe:requests_finished": "counter",
    "vframe:prompt_tokens": "counter",
    "vframe:generation_tokens": "counter",
    "vframe:time_to_first_token_seconds": "histogram",
    "vframe:time_per_output_token_seconds": "histogram",
    "vframe:e2e_request_latency_seconds": "histogram",
    "vframe:num_requests_running": "gauge",
    "vframe:num_requests_waiting": "gauge",
    "vframe:num_preemptions": "counter",
    "vframe:kv_cache_usage_perc": "gauge",
    "vframe:prefix_cache_queries": "counter",
    "vframe:prefix_cache_hits": "counter",
    "vframe:prefix_cache_hit_rate": "gauge",
}


def test_metrics_parse_with_prometheus_parser(server: Server):
    response = httpx.get(server.base_url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f.type for f in text_string_to_metric_families(response.text)}
    assert {name: families.get(name) for name in FAMILIES} == FAMILIES


def test_counters_match_the_requests_sent(server: Server, client: openai.OpenAI):
    before = server.metrics()

    usages = []
    for prompt in ("The capital of France is", "1, 2, 3,", "Hello"):
        usages.append(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0).usage)
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    usages.append([c.usage for c in stream if c.usage is not None][0])
    usages.append(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0, n=2,
            extra_body={"ignore_eos": True},
        ).usage
    )
    assert server.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1}).status_code == 400
    assert server.post("/v1/completions", json={"prompt": "hi", "model": "nope"}).status_code == 404

    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("vframe:http_requests_total", endpoint="/v1/completions", status="200") == 4
    assert delta("vframe:http_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert delta("vframe:http_requests_total", endpoint="/v1/completions", status="400") == 1
    assert delta("vframe:http_requests_total", endpoint="/v1/completions", status="404") == 1
    # 4 completions of one sequence and a chat of two, all cut by max_tokens.
    assert delta("vframe:requests_finished_total", finished_reason="length") == 6
    assert delta("vframe:requests_finished_total", finished_reason="stop") == 0
    assert delta("vframe:requests_finished_total", finished_reason="abort") == 0
    assert delta("vframe:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("vframe:generation_tokens_total") == sum(u.completion_tokens for u in usages) == 4 * 3 + 5 + 6
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        assert delta(f"vframe:{histogram}_count") == 5  # one per engine request
        assert delta(f"vframe:{histogram}_sum") > 0
    assert after[("vframe:kv_cache_usage_perc", ())] == 0.0
    assert after[("vframe:num_requests_running", ())] == 0.0
    assert after[("vframe:num_requests_waiting", ())] == 0.0


def test_prefix_cache_hits_are_counted(server: Server, client: openai.OpenAI):
    prompt = list(range(1000, 1000 + 64))  # 4 full blocks of 16 tokens
    before_hits = server.metric("vframe:prefix_cache_hits_total")
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    # The second request finds the first one's 4 full blocks, less the last token it must recompute.
    assert server.metric("vframe:prefix_cache_hits_total") - before_hits >= 48
    assert 0.0 < server.metric("vframe:prefix_cache_hit_rate") <= 1.0
