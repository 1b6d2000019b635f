"""``LLM.get_metrics()``: vLLM's ``examples/offline_inference/metrics.py`` in its vLLM form,
with only the import (``vllm`` -> ``vframe``) and the model (the embedded SmolLM2 in
float32) changed; lines changed for the test are marked ``# vframe:``."""

from __future__ import annotations

import pytest

from vframe import LLM, SamplingParams
from vframe.v1.metrics.reader import Counter, Gauge, Histogram, Vector

# Sample prompts.
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
# Create a sampling params object.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main():
    # Create an LLM.
    llm = LLM(dtype="float32", max_model_len=512, num_threads=1, disable_log_stats=False)  # vframe: model=

    # Generate texts from the prompts.
    outputs = llm.generate(prompts, sampling_params)

    # Print the outputs.
    print("-" * 50)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}\nGenerated text: {generated_text!r}")
        print("-" * 50)

    # Dump all metrics
    for metric in llm.get_metrics():
        if isinstance(metric, Gauge):
            print(f"{metric.name} (gauge) = {metric.value}")
        elif isinstance(metric, Counter):
            print(f"{metric.name} (counter) = {metric.value}")
        elif isinstance(metric, Vector):
            print(f"{metric.name} (vector) = {metric.values}")
        elif isinstance(metric, Histogram):
            print(f"{metric.name} (histogram)")
            print(f"    sum = {metric.sum}")
            print(f"    count = {metric.count}")
            for bucket_le, value in metric.buckets.items():
                print(f"    {bucket_le} = {value}")
    return llm, outputs  # vframe: for the asserts


@pytest.fixture(scope="module")
def example():
    llm, outputs = main()
    yield llm, outputs
    llm.shutdown()


def _by_name(metrics, name, **labels):
    found = [m for m in metrics if m.name == name and all(m.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name} {labels}: {found}"
    return found[0]


def test_metrics_example_counts_what_generate_did(example, capsys):
    llm, outputs = example
    metrics = llm.get_metrics()
    num_generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    assert num_generated == 4 * 16  # SamplingParams' default max_tokens, unless one stopped early
    assert _by_name(metrics, "vframe:generation_tokens") == Counter("vframe:generation_tokens", {}, num_generated)
    assert _by_name(metrics, "vframe:prompt_tokens").value == num_prompt
    finished = {m.labels["finished_reason"]: m.value for m in metrics if m.name == "vframe:requests_finished"}
    assert finished == {"length": 4}
    assert _by_name(metrics, "vframe:num_requests_running") == Gauge("vframe:num_requests_running", {}, 0)
    assert _by_name(metrics, "vframe:num_requests_waiting").value == 0
    assert _by_name(metrics, "vframe:kv_cache_usage_perc").value == 0.0  # every request gave its blocks back
    assert _by_name(metrics, "vframe:prefix_cache_queries").value == num_prompt
    assert _by_name(metrics, "vframe:prefix_cache_hits").value == 0
    e2e = _by_name(metrics, "vframe:e2e_request_latency_seconds")
    assert isinstance(e2e, Histogram) and e2e.count == 4 == e2e.buckets["+Inf"] and e2e.sum > 0
    # Metrics vframe's LLM does not measure are left out, not reported as zeros.
    names = {m.name for m in metrics}
    assert "vframe:time_to_first_token_seconds" not in names and "vframe:http_requests" not in names


def test_counters_accumulate_and_prefix_cache_hits_show(example):
    llm, _ = example
    before = {m.name: m for m in llm.get_metrics() if isinstance(m, Counter)}
    long_prompt = "Answer in one word. Question: which city is the capital of France? Answer:" * 2
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    first = llm.generate(long_prompt, greedy, use_tqdm=False)[0]
    again = llm.generate(long_prompt, greedy, use_tqdm=False)[0]
    after = {m.name: m for m in llm.get_metrics() if isinstance(m, Counter)}
    assert after["vframe:generation_tokens"].value - before["vframe:generation_tokens"].value == 6
    num_prompt = len(first.prompt_token_ids)
    assert after["vframe:prompt_tokens"].value - before["vframe:prompt_tokens"].value == 2 * num_prompt
    hits = after["vframe:prefix_cache_hits"].value - before["vframe:prefix_cache_hits"].value
    assert hits == again.num_cached_tokens > 0
