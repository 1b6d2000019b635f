"""The rest of vLLM's server surface on /v1/completions: echo (text and prompt
logprobs; with max_tokens=0 the prompt alone), best_of, suffix and prompt_embeds
refused; the shared ``server`` (float32, greedy exact)."""

from __future__ import annotations

import json
import math

import openai
import pytest

from openai_server import Server
from vframe import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


def _events(response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_echo_prepends_the_prompt_to_each_choice(client: openai.OpenAI):
    plain = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0, echo=True)
    assert [c.text for c in echoed.choices] == [PROMPT + plain.choices[0].text, "Hello" + plain.choices[1].text]
    assert echoed.choices[0].text == "The capital of France is Paris.\n\n"
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens == 8
    # a token-id prompt echoes its decoded text
    ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282], max_tokens=1, temperature=0, echo=True)
    assert ids.choices[0].text.startswith("The capital of")


def test_echo_streams_the_prompt_in_each_choices_first_chunk(server: Server):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True, "stream": True}
    events = _events(server.post("/v1/completions", json=body))
    texts = [e["choices"][0]["text"] for e in events]
    assert texts[0].startswith(PROMPT) and not any(PROMPT in t for t in texts[1:])
    assert "".join(texts) == "The capital of France is Paris.\n\n"


def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs_first(client: openai.OpenAI, llm_fp32):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=1)
    logprobs = out.choices[0].logprobs
    prompt_ids = llm_fp32.get_tokenizer()(PROMPT).input_ids
    assert len(logprobs.tokens) == len(prompt_ids) + 2
    assert "".join(logprobs.tokens) == out.choices[0].text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts token 0
    assert logprobs.text_offset[:3] == [0, len("The"), len("The capital")]
    # the prompt tokens' logprobs are the engine's prompt_logprobs (vLLM's echo rule)
    [reference] = llm_fp32.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False
    )
    expected = [entry[tid].logprob for tid, entry in zip(prompt_ids[1:], reference.prompt_logprobs[1:])]
    got = logprobs.token_logprobs[1 : len(prompt_ids)]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got, expected)), (got, expected)
    assert all(len(top) in (1, 2) for top in logprobs.top_logprobs[1:])  # the token itself and the top 1


def test_echo_with_max_tokens_0_returns_the_prompt_alone_and_its_logprobs(server: Server, client: openai.OpenAI):
    kwargs = dict(model=MODEL, prompt=PROMPT, temperature=0, echo=True, logprobs=1)
    alone = client.completions.create(max_tokens=0, **kwargs)
    generated = client.completions.create(max_tokens=2, **kwargs)
    [choice] = alone.choices
    assert choice.text == PROMPT == "The capital of France is"
    assert choice.logprobs.tokens == ["The", " capital", " of", " France", " is"]
    assert choice.logprobs.token_logprobs[0] is None
    # the prompt's logprobs are those echo gives before generated tokens
    assert choice.logprobs.token_logprobs == generated.choices[0].logprobs.token_logprobs[:5]
    assert choice.logprobs.top_logprobs == generated.choices[0].logprobs.top_logprobs[:5]
    assert (alone.usage.prompt_tokens, alone.usage.completion_tokens) == (5, 0)
    # without logprobs, several prompts, and streamed: the prompts alone too
    two = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=0, echo=True)
    assert [c.text for c in two.choices] == [PROMPT, "Hello"] and two.usage.completion_tokens == 0
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "stream": True}
    events = _events(server.post("/v1/completions", json=body))
    assert "".join(e["choices"][0]["text"] for e in events) == PROMPT
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_prompt_embeds_are_refused_naming_the_field(client: openai.OpenAI):
    # vLLM's prompt-embeds client example sends an empty prompt and the embeddings in extra_body
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="", max_tokens=5, extra_body={"prompt_embeds": "AAAA"})
    body = error.value.body
    assert body["param"] == "prompt_embeds"
    assert body["message"].startswith(
        "prompt_embeds: prompt_embeds is not supported yet: vframe's engine takes prompts as text or token ids; "
        "send the prompt's text or token ids in prompt instead"
    )


def test_best_of_returns_the_n_completions_with_the_highest_cumulative_logprob(client: openai.OpenAI):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7, logprobs=0)
    every = client.completions.create(n=4, **kwargs)
    best = client.completions.create(n=2, extra_body={"best_of": 4}, **kwargs)
    assert len(best.choices) == 2 and [c.index for c in best.choices] == [0, 1]

    def total(choice) -> float:
        return sum(choice.logprobs.token_logprobs)

    # per-request seeds: the 4 candidates of best_of=4 are the 4 completions of n=4
    ranked = sorted(every.choices, key=total, reverse=True)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert total(best.choices[0]) >= total(best.choices[1])


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"n": 1, "best_of": 3, "stream": True}, "best_of", "best_of=3 with n=1 cannot be streamed"),
        ({"best_of": 2, "temperature": 0}, "best_of", "must be 1 with greedy sampling"),
        ({"suffix": " and that is all."}, "suffix", 'suffix=" and that is all." is not supported: suffix is only '
         "supported for models with FIM (fill-in-the-middle) completion rendering, and vframe renders none; "
         "leave suffix null"),
    ],
)
def test_best_of_and_suffix_refusals_name_the_field(server: Server, body, param, message):
    response = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


# --------------------------------------------------------------------------- #
# /v1/responses through the official client's client.responses.create
# --------------------------------------------------------------------------- #

QUESTION = "What is the capital of France?"


def test_responses_create_answers_as_chat_does(client: openai.OpenAI):
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        max_tokens=8, temperature=0,
    )
    response = client.responses.create(
        model=MODEL, input=QUESTION, instructions="Be brief.", max_output_tokens=8, temperature=0, top_p=1.0
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output[0].content[0].text == response.output_text == chat.choices[0].message.content
    assert response.output_text == "The capital of France is Paris."
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens,
    )
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert (response.status, response.model, response.output[0].role) == ("completed", MODEL, "assistant")


def test_responses_take_a_message_list_and_report_max_output_tokens_cuts(client: openai.OpenAI):
    response = client.responses.create(
        model=MODEL, max_output_tokens=2, temperature=0,
        input=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "And of Italy?"}]},
        ],
    )
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2 and response.output_text == "Rome."  # the whole conversation was read


def test_responses_stream_openais_events_whose_deltas_make_the_text(client: openai.OpenAI):
    expected = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0)
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == expected.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == expected.output_text and final.usage.output_tokens == expected.usage.output_tokens


def test_responses_refuse_what_they_do_not_serve_naming_the_field(server: Server):
    response = server.post("/v1/responses", json={"input": QUESTION, "previous_response_id": "resp_1"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "previous_response_id"
    response = server.post("/v1/responses", json={"input": [{"role": "user", "content": [{"type": "input_image"}]}]})
    assert response.status_code == 400 and response.json()["error"]["param"].startswith("input")
