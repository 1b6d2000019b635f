"""/v1/chat/completions through the official openai client."""

from __future__ import annotations

import openai

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def stream_chat(stream) -> tuple[dict[int, str], dict[int, str], list[str], object]:
    """(content by choice, finish reason by choice, roles seen, usage) from a stream."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    roles: list[str] = []
    usage = None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role is not None:
                roles.append(choice.delta.role)
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, roles, usage


def test_chat_answers_with_the_chat_template(client: openai.OpenAI):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    assert out.object == "chat.completion"
    assert out.id.startswith("chatcmpl-")
    [choice] = out.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == "The capital of France is Paris."
    assert choice.finish_reason == "stop"
    assert out.usage.completion_tokens == 8  # 7 tokens of text and the end-of-turn token
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_streamed_chat_equals_non_streamed_chat(client: openai.OpenAI):
    conversations = [
        QUESTION,
        [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a color."}],
        [{"role": "user", "content": [{"type": "text", "text": "Write a haiku about the sea."}]}],
    ]
    for messages in conversations:
        full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_completion_tokens=24)
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_completion_tokens=24, stream=True,
            stream_options={"include_usage": True},
        )
        texts, reasons, roles, usage = stream_chat(stream)
        assert texts == {0: full.choices[0].message.content}
        assert reasons == {0: full.choices[0].finish_reason}
        assert roles == ["assistant"]
        assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)


def test_chat_n_2_and_max_completion_tokens(client: openai.OpenAI):
    out = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, n=2, max_completion_tokens=3
    )
    assert [(c.index, c.message.content, c.finish_reason) for c in out.choices] == [
        (0, "The capital of", "length"),
        (1, "The capital of", "length"),
    ]
    assert out.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, n=2, max_tokens=3, stream=True
    )
    texts, reasons, roles, _ = stream_chat(stream)
    assert texts == {0: "The capital of", 1: "The capital of"}
    assert reasons == {0: "length", 1: "length"}
    assert roles == ["assistant", "assistant"]
    # one choice per chunk, as vLLM streams: a client reading choices[0] sees every delta
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, n=2, max_tokens=3,
                                                 stream=True))
    assert all(len(c.choices) == 1 for c in chunks)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert "".join(ch.delta.content or "" for ch in mine) == "The capital of"
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"


def test_chat_stop_string(client: openai.OpenAI):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, stop=" Paris")
    assert out.choices[0].message.content == "The capital of France is"
    assert out.choices[0].finish_reason == "stop"
    texts, reasons, _, _ = stream_chat(
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, stop=" Paris", stream=True)
    )
    assert texts == {0: "The capital of France is"}
    assert reasons == {0: "stop"}


def test_chat_logprobs(client: openai.OpenAI):
    out = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert [t.token for t in content] == ["The", " capital", " of", " France"]
    for token in content:
        assert [t.token for t in token.top_logprobs][0] == token.token  # greedy: the most likely
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob == token.logprob >= token.top_logprobs[1].logprob
        assert bytes(token.bytes).decode() == token.token

    without_top = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=2, logprobs=True
    )
    assert [t.top_logprobs for t in without_top.choices[0].logprobs.content] == [[], []]
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_response_format_json_schema_gives_valid_json(client: openai.OpenAI):
    import json

    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give the capital of France and its population as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        temperature=0,
        max_tokens=120,
    )
    assert resp.choices[0].finish_reason == "stop"  # the grammar closed the object
    jsonschema.validate(json.loads(resp.choices[0].message.content), schema)


def test_logit_bias_and_penalties_reach_the_sampler(client: openai.OpenAI):
    # +100 on one token makes it the greedy choice at every step.
    resp = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logit_bias={"28120": 100}
    )
    assert resp.choices[0].text == "hello" * 4
    penalized = client.completions.create(
        model=MODEL, prompt="1, 1, 1, 1, 1,", max_tokens=8, temperature=0, frequency_penalty=2.0
    )
    plain = client.completions.create(model=MODEL, prompt="1, 1, 1, 1, 1,", max_tokens=8, temperature=0)
    assert penalized.choices[0].text != plain.choices[0].text
