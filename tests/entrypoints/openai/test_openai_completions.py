"""/v1/completions through the official openai client: text and token-id prompts,
streaming and not, n, stop strings, logprobs, seeds, usage."""

from __future__ import annotations

import httpx
import openai

from openai_server import MAX_MODEL_LEN, Server

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


def stream_text(stream) -> tuple[dict[int, str], dict[int, str], object]:
    """(text by choice, finish reason by choice, usage) gathered from a stream."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


def test_greedy_completion(client: openai.OpenAI):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.object == "text_completion"
    assert out.model == MODEL
    assert out.id.startswith("cmpl-")
    [choice] = out.choices
    assert choice.text == " Paris.\n\nThe answer is:"
    assert choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (5, 8, 13)


def test_streamed_text_equals_non_streamed_text(client: openai.OpenAI):
    for prompt in (PROMPT, "def fibonacci(n):", "Once upon a time"):
        full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        stream = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
        texts, reasons, usage = stream_text(stream)
        assert texts == {0: full.choices[0].text}
        assert reasons == {0: full.choices[0].finish_reason}
        assert usage.completion_tokens == full.usage.completion_tokens
        assert usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_without_include_usage_has_no_usage_chunk(client: openai.OpenAI):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True))
    assert all(c.usage is None for c in chunks)
    assert all(len(c.choices) == 1 for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == " Paris.\n\n"


def test_n_2_gives_two_choices_streamed_and_not(client: openai.OpenAI):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == out.choices[1].text == " Paris.\n\nThe answer"
    assert out.usage.completion_tokens == 12

    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, n=2, stream=True)
    texts, reasons, _ = stream_text(stream)
    assert texts == {0: " Paris.\n\nThe answer", 1: " Paris.\n\nThe answer"}
    assert reasons == {0: "length", 1: "length"}
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, n=2,
                                            stream=True))
    assert all(len(c.choices) == 1 for c in chunks)  # one choice per chunk, as vLLM streams
    assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == 1) == " Paris.\n\nThe answer"


def test_seeded_sampling_is_reproducible_and_n_sequences_differ(client: openai.OpenAI):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=7, n=2)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.choices[0].text != first.choices[1].text


def test_stop_string_ends_the_text_streamed_and_not(client: openai.OpenAI):
    kwargs = dict(model=MODEL, prompt="1, 2, 3,", max_tokens=16, temperature=0, stop=[" 6"])
    out = client.completions.create(**kwargs)
    [choice] = out.choices
    assert choice.text == " 4, 5,"
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == " 6"
    texts, reasons, _ = stream_text(client.completions.create(**kwargs, stream=True))
    assert texts == {0: " 4, 5,"}
    assert reasons == {0: "stop"}


def test_token_id_prompts_and_prompt_lists(server: Server, client: openai.OpenAI):
    ids = server.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert len(ids) == 5
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == " Paris.\n\nThe answer is:"

    count_ids = server.post("/tokenize", json={"prompt": "1, 2, 3,"}).json()["tokens"]
    assert len(count_ids) == 8
    out = client.completions.create(model=MODEL, prompt=[ids, count_ids], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [" Paris.\n\nThe answer"] * 2 + [" 4, 5,"] * 2
    assert out.usage.prompt_tokens == 5 + 8
    assert out.usage.completion_tokens == 4 * 6


def test_logprobs_are_the_top_k_and_the_greedy_token_is_first(client: openai.OpenAI):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [0, 6, 7, 8, 9]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3
        assert max(top.values()) == logprob  # greedy picks the most likely token
        assert top[token] == logprob
        assert logprob <= 0.0


def test_logprobs_0_gives_the_sampled_token_and_k_adds_it_to_the_top_k(client: openai.OpenAI):
    zero = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0)
    lp = zero.choices[0].logprobs
    assert [list(top) for top in lp.top_logprobs] == [[token] for token in lp.tokens]
    assert [top[t] for top, t in zip(lp.top_logprobs, lp.tokens)] == lp.token_logprobs
    # sampled at a high temperature, a token outside the top 1 still comes with its own entry
    hot = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=2.0, seed=5, logprobs=1)
    hot_lp = hot.choices[0].logprobs
    for token, logprob, top in zip(hot_lp.tokens, hot_lp.token_logprobs, hot_lp.top_logprobs):
        assert top[token] == logprob and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in hot_lp.top_logprobs)  # this seed samples outside the top 1


def test_max_tokens_null_generates_until_end_of_sequence(client: openai.OpenAI):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], temperature=0
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < MAX_MODEL_LEN


def test_models_tokenize_detokenize_and_openapi(server: Server, client: openai.OpenAI):
    [model] = client.models.list().data
    assert model.id == MODEL
    assert model.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(MODEL).id == MODEL

    tok = server.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert tok == {"count": 2, "max_model_len": MAX_MODEL_LEN, "tokens": [19556, 905], "token_strs": ["Hello", "Ġworld"]}
    assert server.post("/detokenize", json={"tokens": [19556, 905]}).json() == {"prompt": "Hello world"}
    chat = server.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3

    spec = httpx.get(server.base_url + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health"):
        assert path in spec["paths"]
    assert "CompletionRequest" in spec["components"]["schemas"]
