"""vLLM's own request parameters, sent as vLLM users send them (the openai client's
``extra_body``), with vLLM's meaning: prompt_logprobs, return_token_ids, bad_words,
allowed_token_ids, truncate_prompt_tokens, structured_outputs and the guided_* fields,
and chat messages with custom roles. One shared server (the ``server`` fixture)."""

from __future__ import annotations

import asyncio
import copy
import json
import re

import httpx
import openai
import pytest
from openai_server import MAX_MODEL_LEN, Server

from vframe import SamplingParams
from vframe.entrypoints.openai.errors import APIError
from vframe.entrypoints.openai.prompts import PromptBuilder
from vframe.entrypoints.openai.protocol import ChatMessage

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
GREEDY_TEXT = " Paris.\n\nThe answer is:"  # 8 greedy tokens (test_openai_completions)
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def extras(model: object) -> dict:
    """The fields of a response object that the openai client does not know (vLLM's extras)."""
    return model.model_extra or {}


def assert_error(response: httpx.Response, param: str, *words: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]
    return error["message"]


# --------------------------------------------------------------------------- #
# prompt_logprobs
# --------------------------------------------------------------------------- #


def test_completion_prompt_logprobs_equal_the_offline_engines(client: openai.OpenAI, llm_fp32):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    served = extras(out.choices[0])["prompt_logprobs"]
    [offline] = llm_fp32.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    assert len(served) == len(offline.prompt_token_ids) == out.usage.prompt_tokens == 5
    assert served[0] is None and offline.prompt_logprobs[0] is None  # nothing predicts the first token
    for position, (entry, expected) in enumerate(zip(served[1:], offline.prompt_logprobs[1:]), start=1):
        assert set(entry) == {str(t) for t in expected}  # the prompt token and the 2 most likely
        assert str(offline.prompt_token_ids[position]) in entry
        for token_id, lp in expected.items():
            got = entry[str(token_id)]
            assert got["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
            assert (got["rank"], got["decoded_token"]) == (lp.rank, lp.decoded_token)


def test_chat_prompt_logprobs_are_on_the_response(client: openai.OpenAI):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0,
        extra_body={"prompt_logprobs": 0, "return_token_ids": True},
    )
    served, prompt_ids = extras(out)["prompt_logprobs"], extras(out)["prompt_token_ids"]
    assert len(served) == len(prompt_ids) == out.usage.prompt_tokens
    assert served[0] is None
    # k=0: each position holds the prompt token's own entry alone
    assert [list(entry) for entry in served[1:]] == [[str(t)] for t in prompt_ids[1:]]
    assert all(entry[str(t)]["logprob"] <= 0.0 for entry, t in zip(served[1:], prompt_ids[1:]))
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0)
    assert not {"prompt_logprobs", "prompt_token_ids"} & set(extras(plain))


# --------------------------------------------------------------------------- #
# return_token_ids
# --------------------------------------------------------------------------- #


def test_completion_return_token_ids(client: openai.OpenAI, tokenizer):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    out = client.completions.create(**kwargs)
    choice = extras(out.choices[0])
    assert choice["prompt_token_ids"] == tokenizer(PROMPT).input_ids
    assert len(choice["token_ids"]) == out.usage.completion_tokens == 8
    assert tokenizer.decode(choice["token_ids"]) == out.choices[0].text == GREEDY_TEXT

    chunks = list(client.completions.create(stream=True, **kwargs))
    streamed = [extras(c.choices[0]) for c in chunks]
    assert streamed[0]["prompt_token_ids"] == choice["prompt_token_ids"]  # in the first chunk only
    assert all("prompt_token_ids" not in s for s in streamed[1:])
    assert sum((s["token_ids"] for s in streamed), []) == choice["token_ids"]

    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert not {"token_ids", "prompt_token_ids"} & set(extras(plain.choices[0]))


def test_chat_return_token_ids(client: openai.OpenAI, tokenizer):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    out = client.chat.completions.create(**kwargs)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert extras(out)["prompt_token_ids"] == tokenizer(rendered, add_special_tokens=False).input_ids
    token_ids = extras(out.choices[0])["token_ids"]
    assert len(token_ids) == out.usage.completion_tokens
    assert tokenizer.decode(token_ids) == out.choices[0].message.content

    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert extras(chunks[0])["prompt_token_ids"] == extras(out)["prompt_token_ids"]  # the role chunk
    assert sum((extras(c.choices[0]).get("token_ids", []) for c in chunks), []) == token_ids


# --------------------------------------------------------------------------- #
# bad_words, allowed_token_ids, truncate_prompt_tokens
# --------------------------------------------------------------------------- #


def test_bad_words_never_appear(client: openai.OpenAI):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert "Paris" in client.completions.create(**kwargs).choices[0].text
    banned = client.completions.create(**kwargs, extra_body={"bad_words": ["Paris"]}).choices[0].text
    assert "Paris" not in banned and len(banned) > 0
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"bad_words": ["Paris"]}
    )
    assert "Paris" not in chat.choices[0].message.content


def test_allowed_token_ids_are_the_only_tokens_generated(client: openai.OpenAI, tokenizer):
    allowed = sorted({tokenizer.encode(w, add_special_tokens=False)[0] for w in (" London", " Rome", " Berlin", ".")})
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
    )
    token_ids = extras(out.choices[0])["token_ids"]
    assert len(token_ids) == 6 and set(token_ids) <= set(allowed)


def test_truncate_prompt_tokens_keeps_the_last_tokens(client: openai.OpenAI, tokenizer):
    long_prompt = "Here is a long introduction that says nothing at all. " * 3 + PROMPT
    kwargs = dict(model=MODEL, max_tokens=8, temperature=0)
    out = client.completions.create(
        prompt=long_prompt, extra_body={"truncate_prompt_tokens": 5, "return_token_ids": True}, **kwargs
    )
    assert out.usage.prompt_tokens == 5
    assert extras(out.choices[0])["prompt_token_ids"] == tokenizer(long_prompt).input_ids[-5:]
    # the engine ran on exactly those tokens
    alone = client.completions.create(prompt=tokenizer(long_prompt).input_ids[-5:], **kwargs)
    assert out.choices[0].text == alone.choices[0].text
    unchanged = client.completions.create(prompt=PROMPT, extra_body={"truncate_prompt_tokens": -1}, **kwargs)
    assert (unchanged.usage.prompt_tokens, unchanged.choices[0].text) == (5, GREEDY_TEXT)
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"truncate_prompt_tokens": 3}
    )
    assert chat.usage.prompt_tokens == 3


# --------------------------------------------------------------------------- #
# structured output: structured_outputs and guided_*
# --------------------------------------------------------------------------- #


def test_guided_choice_and_structured_outputs_choice(client: openai.OpenAI):
    choices = ["Paris", "London", "Madrid"]
    for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, extra_body=body)
        assert chat.choices[0].message.content in choices
        completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body=body)
        assert completion.choices[0].text in choices


def test_guided_regex_json_and_grammar(client: openai.OpenAI):
    regex = client.completions.create(
        model=MODEL, prompt="A number:", max_tokens=8, extra_body={"guided_regex": "[0-9]{3}-[0-9]{2}"}
    )
    assert re.fullmatch("[0-9]{3}-[0-9]{2}", regex.choices[0].text)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "is_capital": {"type": "boolean"}},
        "required": ["city", "is_capital"],
        "additionalProperties": False,
    }
    for body in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        out = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, extra_body=body
        )
        value = json.loads(out.choices[0].message.content)
        assert set(value) == {"city", "is_capital"} and isinstance(value["is_capital"], bool)
    grammar = 'start: "yes" | "no"'
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"guided_grammar": grammar})
    assert out.choices[0].text in ("yes", "no")


# --------------------------------------------------------------------------- #
# custom roles
# --------------------------------------------------------------------------- #


def test_custom_role_renders_through_the_chat_template(client: openai.OpenAI, tokenizer):
    messages = [{"role": "narrator", "content": "A quiz."}, *MESSAGES]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body={"return_token_ids": True}
    )
    prompt = tokenizer.decode(extras(out)["prompt_token_ids"])
    # SmolLM2's template puts its default system message first, then each message under its role
    assert "<|im_end|>\n<|im_start|>narrator\nA quiz.<|im_end|>\n<|im_start|>user\nWhat is" in prompt


def test_a_template_that_rejects_a_role_is_a_400(tokenizer):
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m.role) }}{% endif %}{{ m.content }}{% endfor %}"
    )
    builder = PromptBuilder(strict, MAX_MODEL_LEN)
    try:
        with pytest.raises(APIError) as raised:
            asyncio.run(builder.chat([ChatMessage(role="narrator", content="hi")]))
    finally:
        builder.shutdown()
    assert (raised.value.status_code, raised.value.param) == (400, "messages")
    assert "the chat template rejected the messages: unknown role narrator" in raised.value.message


# --------------------------------------------------------------------------- #
# bad values
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "path, fields, param, words",
    [
        ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs", ["greater than or equal to 0"]),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs", ["less than or equal to 20"]),
        ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", ["stream=true"]),
        ("/v1/completions", {"return_token_ids": "yes"}, "return_token_ids", ["valid boolean"]),
        ("/v1/completions", {"bad_words": "Paris"}, "bad_words", ["valid list"]),
        ("/v1/completions", {"bad_words": [""]}, "bad_words.0", ["at least 1 character"]),
        ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids", ["at least 1 item"]),
        ("/v1/completions", {"allowed_token_ids": [-1]}, "allowed_token_ids.0", ["greater than or equal to 0"]),
        ("/v1/completions", {"allowed_token_ids": [10**6]}, "allowed_token_ids",
         ["SamplingParams.allowed_token_ids has token ids out of range [0, 49152): [1000000]"]),
        ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ["must be >= 1", "or -1"]),
        ("/v1/completions", {"truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens",
         [f"greater than this model's maximum context length ({MAX_MODEL_LEN})"]),
        ("/v1/chat/completions", {"guided_choice": []}, "guided_choice", ["at least 1 item"]),
        ("/v1/chat/completions", {"guided_regex": "[0-9"}, "guided_regex", ["guided_regex"]),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
         ["structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got regex, choice"]),
        ("/v1/chat/completions", {"structured_outputs": {"whitespace_pattern": " "}},
         "structured_outputs.whitespace_pattern", ["unknown parameter"]),
        ("/v1/chat/completions", {"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
         "guided_json", ["response_format and guided_json both constrain the output"]),
        ("/v1/completions", {"guided_choice": ["a"], "structured_outputs": {"regex": "b"}}, "guided_choice",
         ["structured_outputs and guided_choice both constrain the output"]),
        ("/v1/chat/completions", {"messages": [{"role": "", "content": "hi"}]}, "messages.0.role",
         ["at least 1 character"]),
    ],
)
def test_bad_value_is_a_400_naming_the_field(server: Server, path, fields, param, words):
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    assert_error(server.post(path, json={**base, "max_tokens": 2, **fields}), param, *words)
