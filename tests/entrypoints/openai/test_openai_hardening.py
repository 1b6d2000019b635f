"""Hostile or malformed client input fails alone, with a 4xx in OpenAI's shape,
and never stalls the event loop: client chat templates, body size, grammars,
strict types, lone surrogates, the Host check, logits processors by name."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai_server import API_KEY, Server, start_server, stop_server
from test_openai_errors import assert_error

CHAT = [{"role": "user", "content": "Hi"}]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE_PATTERN = {"type": "string", "pattern": "^(a{1000}){1000}$"}


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """No API key on loopback (so the Host check is on), request templates trusted,
    a 64 KiB body limit and a ``ban_token`` logits processor registered."""
    srv = start_server(
        tmp_path_factory.mktemp("vframe-open"),
        "--trust-request-chat-template", "--max-request-body-bytes", str(64 * 1024),
        api_key=None,
        entry=[sys.executable, str(Path(__file__).with_name("plugin_server.py"))],
    )
    yield srv
    stop_server(srv.process)


def post_raw(server: Server, path: str, body: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """``body`` sent as written: JSON escapes such as a lone ``\\ud800`` reach the server."""
    headers = {"content-type": "application/json", **AUTH, **(headers or {})}
    return httpx.post(server.base_url + path, content=body.encode(), headers=headers, timeout=60)


def max_health_latency(server: Server, work) -> tuple[float, object]:
    """Run ``work()`` while polling /health; (slowest /health answer in seconds, work's result)."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(work()))
    thread.start()
    slowest = 0.0
    while thread.is_alive():
        start = time.perf_counter()
        assert httpx.get(server.base_url + "/health", timeout=60).status_code == 200
        slowest = max(slowest, time.perf_counter() - start)
        time.sleep(0.05)
    thread.join()
    return slowest, result[0]


# --------------------------------------------------------------------------- #
# chat templates
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("path", "extra", "param", "message"),
    [
        ("/v1/chat/completions", {"chat_template": "{{ 1 }}"}, "chat_template", "--trust-request-chat-template"),
        ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
         "chat_template_kwargs.chat_template", "--trust-request-chat-template"),
        ("/tokenize", {"chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
         "chat_template_kwargs.chat_template", "--trust-request-chat-template"),
        ("/v1/chat/completions", {"chat_template_kwargs": {"tools": [{"type": "function"}]}},
         "chat_template_kwargs", "send the tools in the request's tools field"),
        ("/v1/chat/completions", {"chat_template_kwargs": {"tokenize": True}},
         "chat_template_kwargs", "may not set ['tokenize']"),
    ],
)
def test_request_chat_templates_and_tools_are_refused(server: Server, path, extra, param, message):
    response = server.post(path, json={"messages": CHAT, **extra})
    assert message in assert_error(response, 400, param)


def test_trusted_request_template_renders_sandboxed_and_bounded(open_server: Server):
    template = "{% for m in messages %}{{ m.content }}|{% endfor %}"
    rendered = open_server.post("/tokenize", json={"messages": CHAT, "chat_template": template}).json()
    plain = open_server.post("/tokenize", json={"prompt": "Hi|", "add_special_tokens": False}).json()
    assert rendered["tokens"] == plain["tokens"]

    escape = "{{ messages.__class__.__mro__ }}"
    assert "the chat template rejected" in assert_error(
        open_server.post("/tokenize", json={"messages": CHAT, "chat_template": escape}), 400, "messages"
    )
    assert "'*' or '**'" in assert_error(
        open_server.post("/tokenize", json={"messages": CHAT, "chat_template": "{{ 'a' * 1000000000 }}"}),
        400, "chat_template",
    )

    start = time.perf_counter()
    slowest, response = max_health_latency(
        open_server,
        lambda: open_server.post("/v1/chat/completions", json={"messages": CHAT, "chat_template": NESTED_LOOPS}),
    )
    assert "ran longer than 1 s" in assert_error(response, 400, "chat_template")
    assert time.perf_counter() - start < 15
    assert slowest < 2.0  # rendered in a worker thread: the event loop kept answering (it froze for hours)


# --------------------------------------------------------------------------- #
# body size, strict types, lone surrogates, Authorization
# --------------------------------------------------------------------------- #


def test_body_over_the_limit_is_a_413(server: Server, open_server: Server):
    big = {"prompt": "x" * (3 * 2**20)}  # over the default 2 MiB
    assert "over this server's limit of 2097152 bytes" in assert_error(
        server.post("/v1/completions", json=big), 413, None, "request_too_large"
    )

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while read
        yield b'{"prompt": "'
        for _ in range(8):
            yield b"y" * 10_000
        yield b'"}'

    chunked = httpx.post(open_server.base_url + "/v1/completions", content=chunks(),
                         headers={"content-type": "application/json"}, timeout=60)
    assert "limit of 65536 bytes" in assert_error(chunked, 413, None, "request_too_large")
    assert server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "max_tokens", "8"),
        ("/v1/completions", "stream", "false"),
        ("/v1/completions", "n", 2.0),
        ("/v1/completions", "echo", 0),
        ("/v1/chat/completions", "logprobs", "yes"),
        ("/v1/chat/completions", "stream", "false"),
    ],
)
def test_wrong_types_are_refused_not_coerced(server: Server, path, field, value):
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": CHAT}
    assert_error(server.post(path, json={**body, "max_tokens": 2, field: value}), 400, field)


def test_an_integer_is_still_a_valid_float(server: Server):
    response = server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "temperature": 1, "top_p": 1})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"prompt": "abc\\ud800"}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "prompt.1"),
        ("/v1/completions", '{"prompt": "hi", "model": "m\\ud800"}', "model"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
        ("/tokenize", '{"prompt": "abc\\ud800"}', "prompt"),
    ],
)
def test_lone_surrogate_is_a_400(server: Server, path, body, param):
    assert "lone UTF-16 surrogate" in assert_error(post_raw(server, path, body), 400, param)


def test_bearer_scheme_in_any_case(server: Server):
    for scheme in ("Bearer", "bearer", "BEARER"):
        headers = {"Authorization": f"{scheme} {API_KEY}"}
        assert httpx.get(server.api_url + "/models", headers=headers).status_code == 200
    assert httpx.get(server.api_url + "/models", headers={"Authorization": f"Basic {API_KEY}"}).status_code == 401


def test_host_check_on_loopback_without_api_key(open_server: Server, server: Server):
    port = open_server.base_url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", "127.0.0.1", f"127.0.0.2:{port}", "[::1]", f"[::1]:{port}", "LocalHost"):
        assert httpx.get(open_server.base_url + "/health", headers={"Host": host}).status_code == 200, host
    for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.attacker.example"):
        response = httpx.get(open_server.base_url + "/v1/models", headers={"Host": host})
        assert "--allowed-hosts" in assert_error(response, 400, None, "host_not_allowed")
    # With an API key a rebinding page cannot authenticate: any Host is answered.
    assert httpx.get(server.base_url + "/health", headers={"Host": "attacker.example"}).status_code == 200


# --------------------------------------------------------------------------- #
# grammars
# --------------------------------------------------------------------------- #


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_grammar_that_cannot_be_enforced_is_a_400(server: Server):
    self_ref = server.post("/v1/chat/completions",
                           json={"messages": CHAT, "max_tokens": 8, "response_format": _json_schema({"$ref": "#"})})
    assert "no text matches it" in assert_error(self_ref, 400, "response_format")

    slowest, hostile = max_health_latency(
        server,
        lambda: server.post("/v1/chat/completions",
                            json={"messages": CHAT, "max_tokens": 8, "response_format": _json_schema(HOSTILE_PATTERN)}),
    )
    assert "too many expressions constructed" in assert_error(hostile, 400, "response_format")
    assert slowest < 2.0  # compiled in a worker thread


def test_deeply_nested_schema_is_a_400(server: Server):
    depth = 300
    schema = '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth
    body = '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, ' \
           '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}}' % schema
    assert_error(post_raw(server, "/v1/chat/completions", body), 400, "response_format")
    too_deep = '{"prompt": "Hi", "metadata": ' + '{"a": ' * 2000 + "1" + "}" * 2000 + "}"
    assert post_raw(server, "/v1/completions", too_deep).status_code == 400
    assert "Traceback" not in server.log()


# --------------------------------------------------------------------------- #
# logits processors by name
# --------------------------------------------------------------------------- #


def test_unknown_logits_processor_is_a_400_listing_the_known_ones(server: Server, open_server: Server):
    message = assert_error(server.post("/v1/completions", json={"prompt": "Hi", "logits_processors": ["os.system"]}),
                           400, "logits_processors")
    assert "unknown logits processor 'os.system'; this server knows none" in message
    message = assert_error(open_server.post("/v1/completions", json={"prompt": "Hi", "logits_processors": ["nope"]}),
                           400, "logits_processors")
    assert "knows ['ban_token']" in message


def test_registered_logits_processor_runs_per_request(open_server: Server):
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    plain = open_server.post("/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]
    first_text = plain["logprobs"]["tokens"][0]
    first_id = open_server.post("/tokenize", json={"prompt": first_text, "add_special_tokens": False}).json()["tokens"]
    banned = open_server.post(
        "/v1/completions",
        json={**body, "logits_processors": [{"name": "ban_token", "kwargs": {"token_id": first_id[0]}}]},
    ).json()["choices"][0]
    assert not banned["text"].startswith(first_text)
    bad_args = open_server.post("/v1/completions",
                                json={**body, "logits_processors": [{"name": "ban_token", "kwargs": {"x": 1}}]})
    assert "bad arguments" in assert_error(bad_args, 400, "logits_processors")


# --------------------------------------------------------------------------- #
# the OpenAPI spec describes what the server accepts
# --------------------------------------------------------------------------- #


def test_openapi_spec_states_the_constraints(server: Server):
    spec = httpx.get(server.base_url + "/openapi.json").json()["components"]["schemas"]
    completion = spec["CompletionRequest"]["properties"]
    prompt_shapes = completion["prompt"]["anyOf"]
    assert [s.get("minLength", s.get("minItems")) for s in prompt_shapes] == [1, 1, 1, 1]
    assert completion["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 0}  # 0 only with echo
    assert completion["prompt_embeds"]["type"] == "null"
    assert (completion["echo"]["type"], completion["echo"]["default"]) == ("boolean", False)
    assert completion["suffix"]["type"] == "null"
    assert completion["logit_bias"]["anyOf"][0] == {
        "type": "object", "additionalProperties": False,
        "patternProperties": {"^[0-9]+$": {"type": "number", "minimum": -100, "maximum": 100}},
    }
    assert completion["temperature"] == {"type": "number", "minimum": 0.0, "maximum": 2.0,
                                         "title": "Temperature", "description": "0 = greedy", "default": 1.0}

    chat = spec["ChatCompletionRequest"]["properties"]
    assert chat["logprobs"]["type"] == "boolean"
    assert chat["tools"]["anyOf"][0]["items"] == {"$ref": "#/components/schemas/ChatTool"}
    assert set(chat["tool_choice"]["anyOf"][0]["enum"]) == {"none", "auto", "required"}
    assert chat["tool_choice"]["anyOf"][1] == {"$ref": "#/components/schemas/NamedToolChoice"}
    assert "needs logprobs=true" in chat["top_logprobs"]["description"]
    assert "--trust-request-chat-template" in chat["chat_template"]["description"]
    assert "only with stream=true" in chat["stream_options"]["description"]
    assert "413" in httpx.get(server.base_url + "/openapi.json").json()["paths"]["/v1/completions"]["post"]["responses"]
