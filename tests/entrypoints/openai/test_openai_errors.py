"""Bad requests get the right status, OpenAI's error shape and the field at fault;
the server keeps serving afterwards."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai_server import API_KEY, MAX_MODEL_LEN, Server

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Hi"}]


def assert_error(response: httpx.Response, status: int, param: str | None, code: str | None = None) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert error["param"] == param
    assert error["code"] == code
    assert error["message"]
    return error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/completions", {"model": MODEL}, "prompt", "prompt: Field required"),
        ("/v1/chat/completions", {"model": MODEL}, "messages", "messages: Field required"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens", "max_tokens: Input should be a valid integer"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens", "greater than or equal to 0 (got -1)"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens",
         "max_tokens must be at least 1, got 0 (0 is allowed only with echo=true, which returns the prompt alone)"),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
        ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature", "greater than or equal to 0"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p", "greater than 0"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n", "greater than or equal to 1"),
        ("/v1/completions", {"prompt": 42}, "prompt", "must be a string, a list of strings, a list of token ids"),
        ("/v1/completions", {"prompt": [[1, 2], "mixed"]}, "prompt", "must be a string"),
        ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop", "stop: must be a string or a list of strings (got int)"),
        ("/v1/completions", {"prompt": "hi", "temprature": 0}, "temprature", "temprature: unknown parameter"),
        ("/v1/chat/completions", {"messages": [{"role": 5, "content": "hi"}]}, "messages.0.role", "Input should be a valid string"),
        ("/v1/chat/completions", {"messages": []}, "messages", "at least 1 item"),
        ("/v1/completions", {"prompt": ""}, "prompt", "the decoder prompt cannot be empty"),
        ("/v1/completions", {"prompt": [1, 99999]}, "prompt", "token id 99999 is out of vocabulary: prompt token ids out of range [0, 49152): [99999]"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens", "must be <= max_tokens (4)"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs=true"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream=true"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools.0.function", "Field required"),
        ("/v1/completions", {"prompt": "hi", "suffix": "!"}, "suffix", 'suffix="!" is not supported: suffix is only supported for models with FIM'),
        ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 1}, "best_of", "best_of must be greater than or equal to n, got n=2 and best_of=1"),
    ],
)
def test_invalid_request_is_a_400_naming_the_field(server: Server, path, body, param, message):
    response = server.post(path, json=body)
    assert message in assert_error(response, 400, param)


def test_body_that_is_not_a_json_object(server: Server):
    bad_json = server.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert "not valid JSON" in assert_error(bad_json, 400, None)
    a_list = server.post("/v1/completions", json=[1, 2])
    assert "must be a JSON object" in assert_error(a_list, 400, None)


def test_over_long_prompt_is_a_400_context_length_exceeded(server: Server):
    too_long = server.post("/v1/completions", json={"prompt": [7] * (MAX_MODEL_LEN + 10)})
    message = assert_error(too_long, 400, "prompt", "context_length_exceeded")
    assert message.startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens")
    assert f"{MAX_MODEL_LEN + 11}" in message  # the prompt and one token to generate

    with_max_tokens = server.post("/v1/completions", json={"prompt": [7] * 500, "max_tokens": 100})
    message = assert_error(with_max_tokens, 400, "max_tokens", "context_length_exceeded")
    assert "needs 600 (500 in the prompt plus max_tokens=100)" in message

    long_chat = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 600}]})
    assert_error(long_chat, 400, "messages", "context_length_exceeded")


def test_unknown_model_is_a_404(client: openai.OpenAI, server: Server):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert info.value.code == "model_not_found"
    assert "The model 'gpt-4' does not exist" in info.value.message
    assert_error(server.post("/v1/chat/completions", json={"model": "gpt-4", "messages": CHAT}), 404, "model", "model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_wrong_or_missing_api_key_is_a_401(server: Server):
    with openai.OpenAI(base_url=server.api_url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"
    missing = httpx.post(server.api_url + "/completions", json={"prompt": "hi"})
    assert "Missing API key" in assert_error(missing, 401, None, "invalid_api_key")
    for path in ("/v1/models", "/tokenize"):
        assert httpx.get(server.base_url + path).status_code == 401
    # Probes and scrapes need no key.
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 200
    assert httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_unknown_route_and_method(server: Server):
    assert "no route GET /v1/nothing" in assert_error(
        httpx.get(server.base_url + "/v1/nothing", headers={"Authorization": f"Bearer {API_KEY}"}), 404, None
    )
    assert_error(httpx.get(server.base_url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}), 405, None)


def test_server_keeps_serving_after_bad_requests(server: Server, client: openai.OpenAI):
    for body in ({"prompt": "hi", "max_tokens": -3}, {"prompt": [1, 99999]}, {"prompt": [7] * 2000}):
        assert server.post("/v1/completions", json=body).status_code == 400
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
    assert out.choices[0].text == " Paris.\n"
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert "Traceback" not in server.log()
