"""A corpus of hostile request bodies over every endpoint. Each must get a 4xx
answer in OpenAI's error shape, never a 5xx, and leave the server alive and
answering normal requests.

Bodies are raw bytes sent with httpx, so that the test decides the escaping
(``"abc\\ud800"`` is a lone surrogate in JSON's own escape syntax, ``NaN`` is the
non-standard literal that Python's json module accepts). The quick part of the
reliability suite: it runs in ``make test``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from openai_server import Server
from reliability_harness import AUTH, MODEL, error_shape_problems, log_tail, normal_request_problem

BAD = frozenset({400})
MISSING = object()  # a field to drop from the base body

COMPLETION = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
TOKENIZE = {"prompt": "Hello"}
DETOKENIZE = {"tokens": [19556]}
BASES = {
    "/v1/completions": COMPLETION,
    "/v1/chat/completions": CHAT,
    "/tokenize": TOKENIZE,
    "/detokenize": DETOKENIZE,
}


def nested_schema(depth: int) -> dict:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@dataclass(frozen=True)
class Case:
    id: str
    method: str
    path: str
    body: bytes | None = None
    content_type: str | None = "application/json"
    expect: frozenset[int] = BAD
    auth: bool = True


def body_with(path: str, **fields: Any) -> bytes:
    """The base body of ``path`` with ``fields`` set (MISSING drops one); Python's
    json writes huge ints exactly, NaN/Infinity as their literals, and every
    non-ASCII character (lone surrogates included) as a ``\\uXXXX`` escape."""
    body = {k: v for k, v in {**BASES[path], **fields}.items() if v is not MISSING}
    return json.dumps(body).encode()


def raw(text: str) -> bytes:
    return text.encode()


def generic_cases(path: str) -> list[Case]:
    """What every JSON endpoint must refuse."""
    valid = json.dumps(BASES[path]).encode()
    name = path.strip("/").replace("/", "_")
    return [
        Case(f"{name}-invalid-json", "POST", path, b'{"prompt": "a",'),
        Case(f"{name}-json-array", "POST", path, b"[1, 2]"),
        Case(f"{name}-json-string", "POST", path, b'"hello"'),
        Case(f"{name}-json-null", "POST", path, b"null"),
        Case(f"{name}-json-number", "POST", path, b"42"),
        Case(f"{name}-empty-body", "POST", path, b""),
        Case(f"{name}-invalid-utf8", "POST", path, b'{"prompt": "\xff\xfe"}'),
        Case(f"{name}-deep-nesting", "POST", path, b"[" * 100_000 + b"]" * 100_000, expect=frozenset({400, 413})),
        Case(f"{name}-text-plain", "POST", path, valid, content_type="text/plain", expect=frozenset({400, 415})),
        Case(f"{name}-form", "POST", path, b"prompt=hi", content_type="application/x-www-form-urlencoded",
             expect=frozenset({400, 415})),
        Case(f"{name}-no-content-type", "POST", path, valid, content_type=None, expect=frozenset({400, 415})),
        Case(f"{name}-unknown-field", "POST", path, body_with(path, temprature=0.5)),
        Case(f"{name}-empty-object", "POST", path, b"{}"),
        Case(f"{name}-model-surrogate", "POST", path, body_with(path, model="abc\ud800"),
             expect=frozenset({400, 404})),
        Case(f"{name}-model-int", "POST", path, body_with(path, model=5)),
        Case(f"{name}-no-api-key", "POST", path, valid, expect=frozenset({401}), auth=False),
    ]


def sampling_cases(path: str) -> list[Case]:
    """Sampling fields shared by completions and chat."""
    name = "completions" if path == "/v1/completions" else "chat"

    def case(id: str, *, expect: frozenset[int] = BAD, **fields: Any) -> Case:
        return Case(f"{name}-{id}", "POST", path, body_with(path, **fields), expect=expect)

    return [
        case("max-tokens-string", max_tokens="8"),
        case("stream-string", stream="false"),
        case("stream-int", stream=0),
        case("top-k-2**63", top_k=2**63),
        case("seed-2**64", seed=2**64),
        case("seed-2**64-1-n-2", seed=2**64 - 1, n=2),
        case("seed-float", seed=1.5),
        case("stop-token-id-out-of-vocab-min-tokens", stop_token_ids=[99_999_999], min_tokens=2),
        case("stop-token-id-negative", stop_token_ids=[-1]),
        case("logit-bias-1e39", logit_bias={"5": 1e39}),
        case("logit-bias-nan", logit_bias={"5": float("nan")}),
        case("logit-bias-out-of-vocab", logit_bias={"99999999": 1}),
        case("logit-bias-not-a-token-id", logit_bias={"abc": 1}),
        case("max-tokens-negative", max_tokens=-1),
        case("max-tokens-zero", max_tokens=0),
        case("max-tokens-10**30", max_tokens=10**30),
        case("n-zero", n=0),
        case("n-10**30", n=10**30),
        case("temperature-negative", temperature=-1),
        case("temperature-nan", temperature=float("nan")),
        case("temperature-infinity", temperature=float("inf")),
        case("top-p-nan", top_p=float("nan")),
        case("min-p-nan", min_p=float("nan")),
        case("presence-penalty-nan", presence_penalty=float("nan")),
        case("repetition-penalty-nan", repetition_penalty=float("nan")),
        case("repetition-penalty-negative", repetition_penalty=-1),
        case("min-tokens-negative", min_tokens=-1),
        case("min-tokens-above-max-tokens", min_tokens=10, max_tokens=2),
        case("priority-2**100", priority=2**100),
        case("stop-not-strings", stop=[1, 2]),
        case("stream-options-without-stream", stream_options={"include_usage": True}),
        case("json-schema-300-deep",
             response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": nested_schema(300)}}),
        case("json-schema-self-ref",
             response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}),
        case("json-schema-no-schema", response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        case("response-format-unknown-type", response_format={"type": "yaml"}),
    ]


COMPLETIONS = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"


def completion_cases() -> list[Case]:
    def case(id: str, *, expect: frozenset[int] = BAD, **fields: Any) -> Case:
        return Case(f"completions-{id}", "POST", COMPLETIONS, body_with(COMPLETIONS, **fields), expect=expect)

    return [
        case("logprobs-string", logprobs="yes"),
        case("logprobs-above-vocab", logprobs=100_000),
        case("logprobs-21", logprobs=21),
        case("logprobs-negative", logprobs=-1),
        # The escape is written out: \ud800 alone is a lone surrogate, not a character.
        Case("completions-prompt-surrogate", "POST", COMPLETIONS,
             raw(r'{"prompt": "abc\ud800", "max_tokens": 2}')),
        Case("completions-prompt-list-surrogate", "POST", COMPLETIONS,
             raw(r'{"prompt": ["ok", "\udfff"], "max_tokens": 2}')),
        case("prompt-empty", prompt=""),
        case("prompt-empty-list", prompt=[]),
        case("prompt-empty-token-list", prompt=[[]]),
        case("prompt-token-out-of-vocab", prompt=[99_999_999]),
        case("prompt-token-negative", prompt=[-1]),
        case("prompt-token-2**63", prompt=[2**63]),
        case("prompt-int", prompt=5),
        case("prompt-missing", prompt=MISSING),
        case("prompt-too-long", prompt=[1] * 600),
        case("logits-processor-unknown", logits_processors=["no_such_processor"]),
        case("logits-processor-import-path", logits_processors=["os:system"]),
        case("logits-processor-kwargs-for-none", logits_processors=[{"name": "reliability_identity",
                                                                     "kwargs": {"x": 1}}]),
        Case("completions-body-over-limit", "POST", COMPLETIONS,
             body_with(COMPLETIONS, prompt="hello " * (3 * 2**20 // 6)), expect=frozenset({400, 413})),
        case("echo-string", echo="yes"),  # echo=True works (the prompt is prepended)
        case("suffix", suffix="x"),
        case("best-of-3", best_of=3),
    ]


def chat_cases() -> list[Case]:
    def case(id: str, *, expect: frozenset[int] = BAD, **fields: Any) -> Case:
        return Case(f"chat-{id}", "POST", CHAT_PATH, body_with(CHAT_PATH, **fields), expect=expect)

    return [
        case("logprobs-string", logprobs="yes"),
        case("top-logprobs-above-vocab", logprobs=True, top_logprobs=100_000),
        case("top-logprobs-without-logprobs", top_logprobs=5),
        case("max-completion-tokens-string", max_completion_tokens="8"),
        Case("chat-content-surrogate", "POST", CHAT_PATH,
             raw(r'{"messages": [{"role": "user", "content": "abc\ud800"}], "max_tokens": 2}')),
        Case("chat-content-part-surrogate", "POST", CHAT_PATH,
             raw(r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800x"}]}],'
                 r' "max_tokens": 2}')),
        Case("chat-name-surrogate", "POST", CHAT_PATH,
             raw(r'{"messages": [{"role": "user", "content": "hi", "name": "\udc00"}], "max_tokens": 2}')),
        case("messages-empty", messages=[]),
        case("messages-string", messages="hi"),
        case("messages-missing", messages=MISSING),
        case("role-not-a-string", messages=[{"role": 5, "content": "hi"}]),
        case("role-missing", messages=[{"content": "hi"}]),
        case("content-int", messages=[{"role": "user", "content": 5}]),
        case("content-image", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]),
        case("generation-prompt-and-continue", add_generation_prompt=True, continue_final_message=True),
        case("tools", tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        case("chat-template-kwargs-string", chat_template_kwargs="x"),
        # Request templates are refused unless the server runs with --trust-request-chat-template.
        case("chat-template-untrusted", chat_template="{{ messages[0]['content'] }}"),
        case("chat-template-kwargs-template-untrusted",
             chat_template_kwargs={"chat_template": "{{ messages[0]['content'] }}"}),
        case("chat-template-kwargs-tokenize", chat_template_kwargs={"tokenize": True}),
    ]


def tokenize_cases() -> list[Case]:
    path = "/tokenize"
    return [
        Case("tokenize-prompt-surrogate", "POST", path, raw(r'{"prompt": "abc\ud800"}')),
        Case("tokenize-messages-surrogate", "POST", path,
             raw(r'{"messages": [{"role": "user", "content": "abc\ud800"}]}')),
        Case("tokenize-prompt-int", "POST", path, body_with(path, prompt=5)),
        Case("tokenize-prompt-and-messages", "POST", path,
             body_with(path, messages=[{"role": "user", "content": "hi"}])),
        Case("tokenize-return-token-strs-string", "POST", path, body_with(path, return_token_strs="yes")),
        Case("tokenize-add-special-tokens-string", "POST", path, body_with(path, add_special_tokens="false")),
        Case("tokenize-chat-template-kwargs-list", "POST", path,
             json.dumps({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": [1]}).encode()),
    ]


def detokenize_cases() -> list[Case]:
    path = "/detokenize"

    def case(id: str, tokens: Any) -> Case:
        return Case(f"detokenize-{id}", "POST", path, body_with(path, tokens=tokens))

    return [
        case("out-of-vocab", [99_999_999]),
        case("negative", [-1]),
        case("2**63", [2**63]),
        case("string-item", ["a"]),
        case("string", "abc"),
        case("float", [1.5]),
        case("bool", [True]),
        case("missing", MISSING),
    ]


def path_cases() -> list[Case]:
    """The GET endpoints (/v1/models, /v1/models/{id}, /health, /metrics) and routing."""
    long_id = "a" * 8000
    return [
        Case("models-post", "POST", "/v1/models", b"{}", expect=frozenset({405})),
        Case("models-no-api-key", "GET", "/v1/models", None, expect=frozenset({401}), auth=False),
        Case("model-delete", "DELETE", f"/v1/models/{MODEL}", None, expect=frozenset({405})),
        Case("model-unknown", "GET", "/v1/models/not-this-model", None, expect=frozenset({404})),
        # %ED%A0%80 is U+D800 encoded as if it were UTF-8: not valid UTF-8.
        Case("model-surrogate-bytes", "GET", "/v1/models/abc%ED%A0%80", None, expect=frozenset({400, 404})),
        Case("model-invalid-utf8", "GET", "/v1/models/%FF%FE", None, expect=frozenset({400, 404})),
        Case("model-8000-chars", "GET", f"/v1/models/{long_id}", None, expect=frozenset({404, 414})),
        Case("model-dot-dot", "GET", "/v1/models/..%2F..%2Fetc%2Fpasswd", None, expect=frozenset({404})),
        Case("health-post", "POST", "/health", b"{}", expect=frozenset({405})),
        Case("metrics-post", "POST", "/metrics", b"{}", expect=frozenset({405})),
        Case("completions-get", "GET", COMPLETIONS, None, expect=frozenset({405})),
        Case("tokenize-put", "PUT", "/tokenize", b"{}", expect=frozenset({405})),
        Case("unknown-path", "GET", "/v1/nothing-here", None, expect=frozenset({404})),
        Case("wrong-api-key", "GET", "/v1/models", None, expect=frozenset({401}), auth=False),
    ]


CASES = [
    *(c for path in BASES for c in generic_cases(path)),
    *sampling_cases(COMPLETIONS),
    *sampling_cases(CHAT_PATH),
    *completion_cases(),
    *chat_cases(),
    *tokenize_cases(),
    *detokenize_cases(),
    *path_cases(),
]


def send(server: Server, case: Case) -> httpx.Response:
    headers = dict(AUTH) if case.auth else {}
    if case.id == "wrong-api-key":
        headers = {"Authorization": "Bearer not-the-key"}
    if case.content_type is not None:
        headers["Content-Type"] = case.content_type
    return httpx.request(case.method, server.base_url + case.path, content=case.body, headers=headers, timeout=30)


def test_corpus_ids_are_unique():
    ids = [c.id for c in CASES]
    assert sorted({i for i in ids if ids.count(i) > 1}) == []


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_body_gets_a_4xx_and_the_server_lives(server: Server, case: Case):
    try:
        response = send(server, case)
    except httpx.TransportError as e:
        pytest.fail(f"no answer ({e!r}); server log:\n{log_tail(server)}")
    after = normal_request_problem(server)
    assert response.status_code in case.expect, (
        f"got {response.status_code}, expected {sorted(case.expect)}: {response.text[:300]}"
    )
    assert error_shape_problems(response) == []
    assert after is None, f"after it: {after}"
