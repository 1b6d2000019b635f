"""vLLM's own offline examples in their vLLM form: chat, structured outputs, beam
search, logprobs and tool calling.

Each test is the example as vLLM writes it (``examples/offline_inference/basic/chat.py``,
``structured_outputs.py``, ``chat_with_tools.py``, the beam-search and logprobs
snippets of vLLM's docs) with only the import (``vllm`` -> ``vframe``) and the model
(``LLM(model=...)`` -> the shared float32 engine on the embedded SmolLM2) changed;
a line that had to change for the 135M model is marked ``# vframe:``. The asserts
then check what a user of the example relies on.
"""

from __future__ import annotations

import json
import math
import random
import re
import string
from enum import Enum

import pytest
from pydantic import BaseModel

from vframe import LLM, SamplingParams
from vframe.errors import InvalidRequestError
from vframe.sampling_params import BeamSearchParams, GuidedDecodingParams, StructuredOutputsParams

# --------------------------------------------------------------------------- #
# examples/offline_inference/basic/chat.py
# --------------------------------------------------------------------------- #


def test_chat_example_one_conversation_and_a_batch_of_them(llm_fp32: LLM):
    llm = llm_fp32
    sampling_params = SamplingParams(max_tokens=16, temperature=0.0)  # vframe: greedy, so the answer is known

    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)

    # You can run batch inference with llm.chat API
    conversations = [conversation for _ in range(10)]
    batch = llm.chat(conversations, sampling_params, use_tqdm=True)

    [output] = outputs
    assert output.prompt == (
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\nHello! How can I assist you today?<|im_end|>\n<|im_start|>user\n"
        "Write an essay about the importance of higher education.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert output.outputs[0].text == (
        "The importance of higher education cannot be overstated. It is a cornerstone of personal"
    )
    # the chat is the rendered conversation generated as a plain prompt, once per conversation
    [plain] = llm.generate(output.prompt, sampling_params, use_tqdm=False)
    assert plain.outputs[0].token_ids == output.outputs[0].token_ids
    assert len(batch) == 10 and all(o.outputs[0].text == output.outputs[0].text for o in batch)


# --------------------------------------------------------------------------- #
# examples/offline_inference/structured_outputs.py
# --------------------------------------------------------------------------- #

# Structured outputs by Choice (list of possible options)
structured_outputs_params_choice = StructuredOutputsParams(choice=["Positive", "Negative"])
sampling_params_choice = SamplingParams(structured_outputs=structured_outputs_params_choice)
prompt_choice = "Classify this sentiment: vLLM is wonderful!"

# Structured outputs by Regex
structured_outputs_params_regex = StructuredOutputsParams(regex=r"\w+@\w+\.com\n")
sampling_params_regex = SamplingParams(
    structured_outputs=structured_outputs_params_regex, stop=["\n"],
    temperature=0.0, max_tokens=24,  # vframe: greedy, so the output is known
)
prompt_regex = (
    "Generate an email address for Alan Turing, who works in Enigma."
    "End in .com and new line. Example result:"
    "alan.turing@enigma.com\n"
)


# Structured outputs by JSON using Pydantic schema
class CarType(str, Enum):
    sedan = "sedan"
    suv = "SUV"
    truck = "Truck"
    coupe = "Coupe"


class CarDescription(BaseModel):
    brand: str
    model: str
    car_type: CarType


json_schema = CarDescription.model_json_schema()
structured_outputs_params_json = StructuredOutputsParams(json=json_schema)
sampling_params_json = SamplingParams(
    structured_outputs=structured_outputs_params_json,
    temperature=0.0, max_tokens=64,  # vframe: greedy, and room for the whole object (the default is 16 tokens)
)
prompt_json = "Generate a JSON with the brand, model and car_type ofthe most iconic car from the 90's"

# Structured outputs by Grammar
simplified_sql_grammar = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
structured_outputs_params_grammar = StructuredOutputsParams(grammar=simplified_sql_grammar)
sampling_params_grammar = SamplingParams(
    structured_outputs=structured_outputs_params_grammar, max_tokens=64  # vframe: room for the whole statement
)
prompt_grammar = "Generate an SQL query to show the 'username' and 'email'from the 'users' table."


def generate_output(prompt: str, sampling_params: SamplingParams, llm: LLM):
    outputs = llm.generate(prompts=prompt, sampling_params=sampling_params)
    return outputs[0].outputs[0].text


def test_structured_outputs_example_choice_regex_json_and_grammar(llm_fp32: LLM):
    llm = llm_fp32

    choice_output = generate_output(prompt_choice, sampling_params_choice, llm)
    regex_output = generate_output(prompt_regex, sampling_params_regex, llm)
    json_output = generate_output(prompt_json, sampling_params_json, llm)
    grammar_output = generate_output(prompt_grammar, sampling_params_grammar, llm)

    assert choice_output in ("Positive", "Negative")
    # the 135M model does not end its \w+ (greedy, nor sampled with the seeds tried): what
    # it wrote is a prefix the regex allows
    assert regex_output == "Theorem101001110100111011111", regex_output
    assert re.fullmatch(r"\w+(@(\w+(\.(c(om?)?)?)?)?)?", regex_output)
    car = CarDescription.model_validate_json(json_output)  # parses and follows the schema
    assert json.loads(json_output) == {"brand": car.brand, "model": car.model, "car_type": car.car_type.value}
    assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", grammar_output), grammar_output


def test_guided_decoding_params_is_vllms_older_name_of_the_same_constraint(llm_fp32: LLM):
    from vframe.sampling_params import SamplingParams as ModuleSamplingParams

    older = ModuleSamplingParams(
        guided_decoding=GuidedDecodingParams(choice=["Positive", "Negative"]), temperature=0.0
    )
    newer = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"]), temperature=0.0)
    a, b = llm_fp32.generate([prompt_choice, prompt_choice], [older, newer], use_tqdm=False)
    assert a.outputs[0].text == b.outputs[0].text == "Positive"


# --------------------------------------------------------------------------- #
# LLM.beam_search (vLLM's docs, "Beam search")
# --------------------------------------------------------------------------- #


def test_beam_search_example_returns_beam_width_sequences_best_first(llm_fp32: LLM):
    llm = llm_fp32
    params = BeamSearchParams(beam_width=4, max_tokens=8)
    outputs = llm.beam_search([{"prompt": "The capital of France is"}], params)

    [output] = outputs
    prompt_ids = llm.get_tokenizer()("The capital of France is").input_ids
    assert len(output.sequences) == 4
    for seq in output.sequences:
        assert seq.tokens[: len(prompt_ids)] == prompt_ids and len(seq.tokens) == len(prompt_ids) + 8
        assert seq.text == llm.get_tokenizer().decode(seq.tokens) and seq.text.startswith("The capital of France is")
    # all four ran 8 tokens, so the score (length_penalty 1) orders them as their cumulative logprob
    scores = [seq.cum_logprob for seq in output.sequences]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == 4
    assert [seq.text for seq in output.sequences] == [
        "The capital of France is Paris. The capital of Italy is Rome",
        "The capital of France is Paris. The capital of France is not",
        "The capital of France is Paris.\n- The United States has",
        "The capital of France is Paris. The capital of France is Paris",
    ]
    # the best beam scores at least as high as the greedy sequence
    [greedy] = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=8, logprobs=0),
                            use_tqdm=False)
    assert scores[0] >= greedy.outputs[0].cumulative_logprob - 1e-4


# --------------------------------------------------------------------------- #
# SamplingParams(logprobs=, prompt_logprobs=) (vLLM's docs, "Logprobs")
# --------------------------------------------------------------------------- #


def test_logprobs_example_gives_the_sampled_token_with_its_rank_and_the_prompts_logprobs(llm_fp32: LLM):
    llm = llm_fp32
    prompts = ["The capital of France is", "Hello, my name is"]
    sampling_params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, prompt_logprobs=3)
    outputs = llm.generate(prompts, sampling_params, use_tqdm=False)

    tokenizer = llm.get_tokenizer()
    assert outputs[0].outputs[0].text == " Paris.\n\n"
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids) == 4
        for token_id, entry in zip(completion.token_ids, completion.logprobs):
            # greedy: the sampled token is the most likely one, inside the top 5
            assert len(entry) == 5 and entry[token_id].rank == 1
            assert entry[token_id].logprob == max(lp.logprob for lp in entry.values())
            assert sorted(lp.rank for lp in entry.values()) == [1, 2, 3, 4, 5]
            assert entry[token_id].decoded_token == tokenizer.decode([token_id])
        total = sum(entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs))
        assert math.isclose(completion.cumulative_logprob, total, rel_tol=1e-5)

        prompt_ids = tokenizer(prompt).input_ids
        assert output.prompt_token_ids == prompt_ids and len(output.prompt_logprobs) == len(prompt_ids)
        assert output.prompt_logprobs[0] is None  # nothing before the first token predicts it
        for token_id, entry in zip(prompt_ids[1:], output.prompt_logprobs[1:]):
            # the prompt's own token, with its rank, and the top 3
            assert token_id in entry and entry[token_id].rank >= 1
            assert {lp.rank for lp in entry.values()} >= {1, 2, 3} and len(entry) in (3, 4)


# --------------------------------------------------------------------------- #
# examples/offline_inference/chat_with_tools.py
# --------------------------------------------------------------------------- #

# vframe: the 135M model does not write tool calls by itself, so its reply is held to a
# JSON list of calls of the tools (what the example's Mistral model writes)
CALLS_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "maxItems": 1,
    "items": {
        "type": "object",
        "properties": {
            "name": {"const": "get_current_weather"},
            "arguments": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Dallas"]},
                    "state": {"enum": ["TX"]},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "state", "unit"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}

# A tool-use template (SmolLM2's own renders neither tools nor calls): it lists the tools
# and indexes each call's arguments as a mapping, as tool-use templates do.
TOOL_TEMPLATE = (
    "{% for t in tools %}tool {{ t.function.name }}{{ '\\n' }}{% endfor %}"
    "{% for m in messages %}{{ m.role }}: "
    "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name }}(city={{ c.function.arguments.city }}, "
    "unit={{ c.function.arguments.unit }}){% endfor %}{% else %}{{ m.content }}{% endif %}{{ '\\n' }}{% endfor %}"
    "assistant:"
)


def generate_random_id(length=9):
    characters = string.ascii_letters + string.digits
    random_id = "".join(random.choice(characters) for _ in range(length))
    return random_id


# simulate an API that can be called
def get_current_weather(city: str, state: str, unit: "str"):
    return f"The weather in {city}, {state} is 85 degrees {unit}. It is partly cloudly, with highs in the 90's."


tool_functions = {"get_current_weather": get_current_weather}

tools = [
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "description": "Get the current weather in a given location",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city to find the weather for, e.g. 'San Francisco'"},
                    "state": {
                        "type": "string",
                        "description": "the two-letter abbreviation for the state that the city is in, e.g. 'CA' "
                        "which would mean 'California'",
                    },
                    "unit": {
                        "type": "string",
                        "description": "The unit to fetch the temperature in",
                        "enum": ["celsius", "fahrenheit"],
                    },
                },
                "required": ["city", "state", "unit"],
            },
        },
    }
]


def test_chat_with_tools_example_round_trip(llm_fp32: LLM):
    llm = llm_fp32
    sampling_params = SamplingParams(
        max_tokens=64, temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=CALLS_SCHEMA),  # vframe: see CALLS_SCHEMA
    )

    messages = [{"role": "user", "content": "Can you tell me what the temperate will be in Dallas, in fahrenheit?"}]

    outputs = llm.chat(messages, sampling_params=sampling_params, tools=tools)
    output = outputs[0].outputs[0].text.strip()
    output = output.removeprefix("[TOOL_CALLS]")

    # append the assistant message
    messages.append({"role": "assistant", "content": output})

    # let's now actually parse and execute the model's output simulating an API call by using the
    # above defined function
    tool_calls = json.loads(output)
    tool_answers = [tool_functions[call["name"]](**call["arguments"]) for call in tool_calls]

    # append the answer as a tool message and let the LLM give you an answer
    messages.append({"role": "tool", "content": "\n\n".join(tool_answers), "tool_call_id": generate_random_id()})

    outputs = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0.0), tools=tools)  # vframe: greedy

    assert [call["name"] for call in tool_calls] == ["get_current_weather"]
    assert tool_calls[0]["arguments"]["city"] == "Dallas" and tool_calls[0]["arguments"]["state"] == "TX"
    # the follow-up prompt holds the call and its result, then asks the assistant to go on
    prompt = outputs[0].prompt
    assert f"<|im_start|>assistant\n{output}<|im_end|>\n" in prompt
    assert f"<|im_start|>tool\n{tool_answers[0]}<|im_end|>\n<|im_start|>assistant\n" in prompt
    assert len(outputs[0].outputs[0].token_ids) > 0


def test_assistant_tool_calls_with_json_string_arguments_render_as_objects(llm_fp32: LLM):
    """OpenAI's (and vLLM's) message shape: ``function.arguments`` is a JSON string; the
    template gets the object, as vLLM and ``vframe serve`` render it."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_current_weather", "arguments": '{"city": "Dallas", "unit": "fahrenheit"}'}}
    messages = [
        {"role": "user", "content": "Weather in Dallas?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "85 degrees"},
    ]
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    [out] = llm_fp32.chat(messages, greedy, use_tqdm=False, chat_template=TOOL_TEMPLATE, tools=tools)
    assert out.prompt == (
        "tool get_current_weather\nuser: Weather in Dallas?\n"
        "assistant: get_current_weather(city=Dallas, unit=fahrenheit)\ntool: 85 degrees\nassistant:"
    )
    assert call["function"]["arguments"] == '{"city": "Dallas", "unit": "fahrenheit"}'  # the caller's message is kept
    # arguments already an object render the same
    as_object = {**call, "function": {**call["function"], "arguments": {"city": "Dallas", "unit": "fahrenheit"}}}
    [same] = llm_fp32.chat([messages[0], {**messages[1], "tool_calls": [as_object]}, messages[2]], greedy,
                           use_tqdm=False, chat_template=TOOL_TEMPLATE, tools=tools)
    assert same.prompt == out.prompt and same.outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.parametrize("arguments", ['{"city": "Dal', '["Dallas"]'])
def test_tool_call_arguments_that_are_not_a_json_object_are_refused_naming_them(llm_fp32: LLM, arguments):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_current_weather", "arguments": arguments}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(InvalidRequestError) as error:
        llm_fp32.chat(messages, use_tqdm=False, chat_template=TOOL_TEMPLATE, tools=tools)
    assert str(error.value) == (
        f"messages[1].tool_calls[0].function.arguments must be a JSON object, as a string; got {arguments!r}"
    )


# --------------------------------------------------------------------------- #
# prompt_embeds: not supported yet
# --------------------------------------------------------------------------- #


def test_prompt_embeds_prompts_are_refused_naming_them(llm_fp32: LLM):
    import torch

    embeds = torch.zeros(3, 576)
    message = (
        "prompt_embeds is not supported yet: vframe's engine takes prompts as text or token ids "
        "(vframe.inputs.TextPrompt / TokensPrompt); pass the prompt's text or prompt_token_ids instead"
    )
    with pytest.raises(InvalidRequestError) as error:
        llm_fp32.generate({"prompt_embeds": embeds}, use_tqdm=False)
    assert str(error.value) == message
    with pytest.raises(InvalidRequestError) as error:
        llm_fp32.beam_search([{"prompt_embeds": embeds}], BeamSearchParams(beam_width=2, max_tokens=2))
    assert str(error.value) == message
