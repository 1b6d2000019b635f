"""A request whose logits processor raises mid-step fails alone: requests in the
same batch complete with their usual tokens, and the next identical prompt gets
the tokens a clean engine gives (no KV block, prefix-cache entry or sampler state
of the failed request leaks into it).

Served: the processors come from ``reliability_plugin`` (registered by
``reliability_launcher.py``) and requests name them in ``logits_processors``; the
failed request gets a 500 in OpenAI's error shape (a plugin failed, not the
client), a failed stream an error event. In-process: ``LLM.generate`` returns
the failed request finished with ``finish_reason == "error"``.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import reliability_plugin
from openai_server import Server
from reliability_harness import (
    AUTH,
    error_object_problems,
    error_shape_problems,
    idle_gauges,
    normal_request_problem,
    run_concurrently,
    stream,
)
from reliability_plugin import ERROR_TEXT, IDENTITY, RAISE_ON_CALL_1, RAISE_ON_CALL_3

from vframe import LLM, SamplingParams
from vframe.plugins import register_plugin, unregister_plugin

pytestmark = pytest.mark.reliability

PROMPTS = ["The capital of France is", "Once upon a time", "Water boils at", "The largest planet is"]
MAX_TOKENS = 16


def complete(client: httpx.Client, prompt: str, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}
    return client.post("/v1/completions", json=body, headers=AUTH, timeout=120)


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text[:300]
    return response.json()["choices"][0]["text"]


def test_a_raising_logits_processor_fails_only_its_request(server: Server):
    with httpx.Client(base_url=server.base_url) as client:
        reference = [text_of(complete(client, p)) for p in PROMPTS]
        identity = complete(client, PROMPTS[0], logits_processors=[IDENTITY])
        assert identity.status_code == 200, f"the server does not run named logits processors: {identity.text[:300]}"
        assert text_of(identity) == reference[0]

        base = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        chat = {"messages": [{"role": "user", "content": PROMPTS[3]}], **base}
        jobs = {
            "normal-0": lambda: complete(client, PROMPTS[0]),
            "normal-1": lambda: complete(client, PROMPTS[1]),
            "normal-stream-2": lambda: stream(client, "/v1/completions", {"prompt": PROMPTS[2], **base}),
            "normal-stream-3": lambda: stream(client, "/v1/completions", {"prompt": PROMPTS[3], **base}),
            "raise-mid-decode": lambda: complete(client, PROMPTS[0], logits_processors=[RAISE_ON_CALL_3]),
            "raise-after-prefill": lambda: complete(client, PROMPTS[1], logits_processors=[RAISE_ON_CALL_1]),
            "raise-stream": lambda: stream(
                client, "/v1/completions", {"prompt": PROMPTS[2], "logits_processors": [RAISE_ON_CALL_3], **base}
            ),
            "raise-chat-stream": lambda: stream(
                client, "/v1/chat/completions", {**chat, "logits_processors": [RAISE_ON_CALL_3]}
            ),
        }
        results = run_concurrently(jobs, timeout_s=180)

        # The requests beside the failing ones completed with their usual tokens.
        assert [text_of(results[f"normal-{i}"]) for i in (0, 1)] == reference[:2]
        for i in (2, 3):
            assert results[f"normal-stream-{i}"].well_formed_problem() is None
            assert results[f"normal-stream-{i}"].text == reference[i]

        # The failing requests got an error: a 500 (a plugin failed, not the client) ...
        for key in ("raise-mid-decode", "raise-after-prefill"):
            response = results[key]
            assert isinstance(response, httpx.Response), response
            assert response.status_code == 500, f"{key}: {response.status_code} {response.text[:300]}"
            assert error_shape_problems(response) == []
        # ... or, once streaming, an error event and the end of the stream.
        for key in ("raise-stream", "raise-chat-stream"):
            result = results[key]
            assert result.status == 200 and result.transport_error is None, (key, result)
            assert [error_object_problems(e) for e in result.errors] == [[]], f"{key}: {result.events[-3:]}"
            assert not set(result.finish_reasons) & {"stop", "length"}, result.finish_reasons

        # Nothing of the failed requests is left, and the same prompts give the same tokens.
        assert normal_request_problem(server) is None
        assert idle_gauges(server) == {
            "vframe:kv_cache_usage_perc": 0.0, "vframe:num_requests_running": 0.0, "vframe:num_requests_waiting": 0.0,
        }
        assert [text_of(complete(client, p)) for p in PROMPTS] == reference
        assert text_of(complete(client, PROMPTS[0], logits_processors=[IDENTITY])) == reference[0]


# --------------------------------------------------------------------------- #
# in-process: LLM.generate
# --------------------------------------------------------------------------- #


def raise_after_two_tokens(output_token_ids: list[int], logits):
    """A plain-callable processor (shared by every request given it, so stateless)."""
    if len(output_token_ids) >= 2:
        raise RuntimeError(f"{ERROR_TEXT} after {len(output_token_ids)} tokens")
    return logits


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    register_plugin(reliability_plugin, "reliability")
    try:
        # One thread: OpenMP teams spin, and this process shares its cores with servers.
        yield LLM(dtype="float32", max_model_len=512, num_threads=1)
    finally:
        unregister_plugin("reliability")


@pytest.fixture(scope="module")
def fresh_tokens(llm: LLM) -> list[list[int]]:
    """Greedy tokens of PROMPTS from the engine before any request failed in it."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("processor", [raise_after_two_tokens, RAISE_ON_CALL_3, RAISE_ON_CALL_1],
                         ids=["callable", "plugin-mid-decode", "plugin-after-prefill"])
def test_generate_reports_the_failed_request_and_completes_the_others(llm: LLM, fresh_tokens, processor):
    normal = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    failing = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logits_processors=[processor])
    # The failing request shares a prompt with a normal one: same prefix-cache blocks.
    outputs = llm.generate([*PROMPTS, PROMPTS[0]], [normal] * len(PROMPTS) + [failing], use_tqdm=False)

    failed = outputs[-1]
    assert failed.finished
    assert failed.outputs[0].finish_reason == "error"
    assert ERROR_TEXT in str(failed.outputs[0].error)
    assert len(failed.outputs[0].token_ids) < MAX_TOKENS
    assert [out.outputs[0].token_ids for out in outputs[:-1]] == fresh_tokens
    assert [out.outputs[0].finish_reason for out in outputs[:-1]] == ["length"] * len(PROMPTS)

    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.get_stats()["kv_cache_usage"] == 0.0
    again = llm.generate(PROMPTS, normal, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in again] == fresh_tokens
