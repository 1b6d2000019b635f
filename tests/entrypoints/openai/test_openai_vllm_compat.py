"""vLLM's server flags and request fields: --enable-prompt-tokens-details,
stream_options.continuous_usage_stats, --generation-config defaults, and the
accepted no-op fields prompt_cache_key and reasoning_effort (one server)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai_server import Server, start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def compat_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    generation_dir = tmp_path_factory.mktemp("generation-config")
    (generation_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    srv = start_server(
        Path(tmp_path_factory.mktemp("vframe-serve-compat")),
        "--enable-prompt-tokens-details",
        "--enforce-eager",
        "--disable-log-stats",
        "--kv-cache-dtype", "auto",
        "--compilation-config", "0",
        "--generation-config", str(generation_dir),
        "--served-model-name", "smol", "smollm2-alias",
        "--chat-template", str(_write(generation_dir / "template.jinja", CHAT_TEMPLATE)),
    )
    yield srv
    stop_server(srv.process)


# --chat-template FILE: a template of the operator's, used instead of the model's
CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _events(response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_prompt_tokens_details_counts_prefix_cache_hits(compat_server: Server):
    body = {"prompt": list(range(1000, 1040)), "max_tokens": 1, "temperature": 0}
    usages = [compat_server.post("/v1/completions", json=body).json()["usage"] for _ in range(2)]
    # 40 prompt tokens, blocks of 16: the second request finds 2 full blocks cached.
    assert [u["prompt_tokens_details"] for u in usages] == [{"cached_tokens": 0}, {"cached_tokens": 32}]
    assert usages[1]["prompt_tokens"] == 40


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(compat_server: Server, path: str):
    body = {
        "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    body |= {"prompt": "Once upon a time"} if path == "/v1/completions" else {"messages": MESSAGES}
    events = _events(compat_server.post(path, json=body))
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + c for e, c in zip(events, counts))
    assert counts == sorted(counts) and counts[-1] == 4 and counts[-2] == 4  # the last chunk: usage only
    assert events[-1]["choices"] == []


def test_generation_config_defaults_fill_unset_fields_and_no_op_fields_are_accepted(compat_server: Server):
    body = {"messages": MESSAGES, "ignore_eos": True, "prompt_cache_key": "user-42", "reasoning_effort": "low"}
    response = compat_server.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["usage"]["completion_tokens"] == 3  # max_new_tokens of generation_config.json
    assert out["choices"][0]["finish_reason"] == "length"
    again = compat_server.post("/v1/chat/completions", json={"messages": MESSAGES, "ignore_eos": True}).json()
    assert again["choices"][0]["message"]["content"] == out["choices"][0]["message"]["content"]  # temperature 0
    body = {"messages": MESSAGES, "max_tokens": 5, "ignore_eos": True}
    explicit = compat_server.post("/v1/chat/completions", json=body).json()
    assert explicit["usage"]["completion_tokens"] == 5


def test_ping_answers_as_health_does_for_get_and_post(compat_server: Server):
    import httpx

    # like /health, open without the API key (a load balancer's probe)
    for method in ("GET", "POST"):
        response = httpx.request(method, compat_server.base_url + "/ping", timeout=10)
        assert (response.status_code, response.json()) == (200, {})


def test_served_model_names_are_all_accepted_and_listed_and_answers_give_the_first(compat_server: Server):
    import httpx

    models = httpx.get(compat_server.base_url + "/v1/models", headers={"Authorization": "Bearer test-key-123"})
    assert [m["id"] for m in models.json()["data"]] == ["smol", "smollm2-alias"]
    for name in ("smol", "smollm2-alias"):
        body = {"model": name, "prompt": "Hi", "max_tokens": 1}
        response = compat_server.post("/v1/completions", json=body)
        assert (response.status_code, response.json()["model"]) == (200, "smol")
    unknown = compat_server.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


def test_chat_template_flag_renders_conversations_with_the_given_template(compat_server: Server):
    messages = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    ids = compat_server.post("/tokenize", json={"messages": messages}).json()["tokens"]
    text = compat_server.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == "[system] Be brief.\n[user] What is the capital of France?\n[assistant] "


def test_chat_template_flag_takes_a_file_or_the_template_and_refuses_a_missing_path(tmp_path: Path):
    from vframe.entrypoints.openai.args import load_chat_template
    from vframe.errors import ConfigError

    assert load_chat_template(str(_write(tmp_path / "t.jinja", CHAT_TEMPLATE))) == CHAT_TEMPLATE
    assert load_chat_template(CHAT_TEMPLATE) == CHAT_TEMPLATE
    with pytest.raises(ConfigError) as error:
        load_chat_template(str(tmp_path / "missing.jinja"))
    assert str(error.value) == (
        f"--chat-template {str(tmp_path / 'missing.jinja')!r} looks like a file path, but it cannot be read "
        "(No such file or directory); give a template file or the template itself"
    )


def test_version_is_vframes(compat_server: Server):
    import httpx

    from vframe.version import __version__

    assert httpx.get(compat_server.base_url + "/version", timeout=10).json() == {"version": __version__}
