"""Tool calling through the official openai client against ``vframe serve`` on SmolLM2.

A 135M model does not call tools by itself, so the calls here come from
``tool_choice="required"`` and named functions (decoded to follow the tools'
schemas) and from ``"auto"`` with the reply forced into a Llama-3 JSON call by
``response_format`` (read by the server's ``llama3_json`` parser). The expected
calls are what greedy float32 decoding gives.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from openai_server import Server, start_server, stop_server

from vframe.entrypoints.cli import main
from vframe.entrypoints.openai.protocol import ChatCompletionRequest
from vframe.entrypoints.openai.tool_parsers import HermesToolParser
from vframe.entrypoints.openai.tools import ToolCallingConfig, ToolChoice

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["CET", "UTC", "JST"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "temperature": 0, "max_tokens": 40}


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("vframe-tools"),
        "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json", "--trust-request-chat-template",
    )
    yield srv
    stop_server(srv.process)


@pytest.fixture
def tool_client(tool_server: Server) -> Iterator[openai.OpenAI]:
    with tool_server.client() as c:
        yield c


def calls_of(message) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, checking the call's shape on the way."""
    for call in message.tool_calls:
        assert call.type == "function"
        assert call.id.startswith("chatcmpl-tool-") and len(call.id) == len("chatcmpl-tool-") + 32
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def accumulate(stream) -> tuple[str, list[tuple[str, str, str]], str | None]:
    """(content, [(id, name, arguments)], finish reason) from streamed deltas, checking that
    each call's first delta has its id, type and name, and later ones only arguments."""
    content, finish_reason = "", None
    calls: dict[int, list[str]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = [delta.id, delta.function.name, ""]
                else:
                    assert delta.id is None and delta.function.name is None
                calls[delta.index][2] += delta.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return content, [tuple(calls[i]) for i in sorted(calls)], finish_reason


def streamed_calls(stream) -> tuple[str, list[tuple[str, dict]], str | None]:
    content, calls, finish_reason = accumulate(stream)
    return content, [(name, json.loads(arguments)) for _, name, arguments in calls], finish_reason


# --------------------------------------------------------------------------- #
# required and named: the structured-output engine makes the calls valid
# --------------------------------------------------------------------------- #


def test_required_returns_calls_that_follow_the_tools_schemas(tool_client: openai.OpenAI):
    out = tool_client.chat.completions.create(**GREEDY, tool_choice="required")
    [choice] = out.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris", "unit": "fahrenheit"})]

    with tool_client.chat.completions.stream(**GREEDY, tool_choice="required") as stream:
        final = stream.get_final_completion().choices[0]  # the openai client's own accumulation
    assert final.finish_reason == "tool_calls"
    assert calls_of(final.message) == calls_of(choice.message)


def test_named_function_call_follows_its_parameters_schema_and_streams_its_arguments(tool_client: openai.OpenAI):
    named = {"type": "function", "function": {"name": "get_time"}}
    out = tool_client.chat.completions.create(**GREEDY, tool_choice=named)
    [choice] = out.choices
    assert choice.finish_reason == "stop"  # OpenAI's rule for a named function
    assert choice.message.content is None
    [(name, arguments)] = calls_of(choice.message)
    assert name == "get_time"
    assert arguments == {"tz": "CET"}

    stream = tool_client.chat.completions.create(**GREEDY, tool_choice=named, stream=True)
    content, [(call_id, name, text)], finish_reason = accumulate(stream)
    assert (content, name, finish_reason) == ("", "get_time", "stop")
    assert text == choice.message.tool_calls[0].function.arguments


def test_auto_reads_the_calls_the_model_wrote_with_the_servers_parser(tool_client: openai.OpenAI):
    # the reply is forced into a Llama-3 JSON call, which the server's llama3_json parser reads
    call_schema = {
        "type": "object",
        "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER["function"]["parameters"]},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }
    forced = {
        **GREEDY, "tool_choice": "auto",
        "response_format": {"type": "json_schema", "json_schema": {"name": "call", "schema": call_schema}},
    }
    out = tool_client.chat.completions.create(**forced)
    [choice] = out.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris", "unit": "fahrenheit"})]
    assert streamed_calls(tool_client.chat.completions.create(**forced, stream=True)) == (
        "", calls_of(choice.message), "tool_calls"
    )

    # free text that is not a call stays content (tools default to auto)
    free = tool_client.chat.completions.create(**{**GREEDY, "max_tokens": 6})
    [choice] = free.choices
    assert (choice.finish_reason, choice.message.tool_calls) == ("length", [])
    assert choice.message.content == "Paris, the City of Light"


def test_auto_stream_adds_up_to_the_parsed_reply():
    """The server's parsing path on a known Hermes-style reply, cut into tokens."""
    request = ChatCompletionRequest(messages=QUESTION, tools=TOOLS, tool_choice="auto")
    choice = ToolChoice.of(request, ToolCallingConfig(enable_auto_tool_choice=True, parser=HermesToolParser))
    text = (
        "Let me look that up.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    )
    reply = choice.reply(text, "stop")
    assert (reply.content, reply.finish_reason) == ("Let me look that up.", "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "CET"}),
    ]

    stream = choice.stream()
    contents, deltas = [], []
    for i in range(0, len(text), 3):
        content, calls = stream.add(text[i:i + 3])
        contents.append(content)
        deltas += calls
    assert "".join(contents) == "Let me look that up."  # sent as it came, nothing of the calls
    assert deltas == []
    rest, deltas, finish_reason = stream.finish("stop")
    assert (rest, finish_reason) == ("", "tool_calls")
    assert [(d.index, d.type, d.function.name, d.function.arguments) for d in deltas] == [
        (i, "function", c.function.name, c.function.arguments) for i, c in enumerate(reply.tool_calls)
    ]


def test_forced_calls_allow_only_the_declared_properties_as_vllm_does():
    loose = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
            "extra": {"type": "object", "additionalProperties": True},
            "fixed": {"const": {"type": "object"}},
        },
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": loose}}]
    request = ChatCompletionRequest(messages=QUESTION, tools=tools, tool_choice="required")
    [variant] = ToolChoice.of(request, ToolCallingConfig()).structured_outputs().json["items"]["anyOf"]
    parameters = variant["properties"]["parameters"]
    assert parameters["additionalProperties"] is False
    assert parameters["properties"]["where"]["additionalProperties"] is False
    assert parameters["properties"]["extra"]["additionalProperties"] is True  # said explicitly: kept
    assert parameters["properties"]["fixed"] == {"const": {"type": "object"}}  # a value, not a schema
    assert "additionalProperties" not in loose  # the request's tools are not changed


def test_required_decodes_vllms_array_of_names_and_parameters():
    request = ChatCompletionRequest(messages=QUESTION, tools=[TIME], tool_choice="required", parallel_tool_calls=False)
    constraint = ToolChoice.of(request, ToolCallingConfig()).structured_outputs()
    assert constraint.json == {
        "type": "array",
        "minItems": 1,
        "maxItems": 1,  # parallel_tool_calls=false
        "items": {"anyOf": [{
            "type": "object",
            "properties": {"name": {"type": "string", "enum": ["get_time"]}, "parameters": TIME["function"]["parameters"]},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }]},
    }


def test_tool_choice_none_gives_the_template_the_tools_unless_the_operator_excludes_them():
    request = ChatCompletionRequest(messages=QUESTION, tools=[TIME], tool_choice="none")
    assert ToolChoice.of(request, ToolCallingConfig()).template_tools == [TIME]
    excluding = ToolCallingConfig(exclude_tools_when_tool_choice_none=True)
    assert ToolChoice.of(request, excluding).template_tools is None


# --------------------------------------------------------------------------- #
# the conversation: tools and tool calls reach the chat template
# --------------------------------------------------------------------------- #

# A request template that prints what a tool-use template reads.
TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}{{ m.tool_calls[0].function.name }}("
    "{{ m.tool_calls[0].function.arguments.city }}){% else %}{{ m.content }}{% endif %}|{% endfor %}"
    "{% for t in tools or [] %}{{ t.function.name }};{% endfor %}"
)
ROUND_TRIP = [
    *QUESTION,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "chatcmpl-tool-1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
    ]},
    {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "18 degrees, sunny"},
]


def test_tool_calls_and_tool_results_render_through_the_chat_template(tool_server: Server, tool_client):
    body = {"messages": ROUND_TRIP, "tools": TOOLS, "chat_template": TEMPLATE, "add_generation_prompt": False}
    rendered = tool_server.post("/tokenize", json=body).json()
    expected = (
        "user:What is the weather in Paris?|assistant:get_weather(Paris)|tool:18 degrees, sunny|"
        "get_weather;get_time;"
    )
    plain = tool_server.post("/tokenize", json={"prompt": expected, "add_special_tokens": False}).json()
    assert rendered["tokens"] == plain["tokens"]

    # the follow-up turn with the model's template; tool_choice none still gives the template the tools
    out = tool_client.chat.completions.create(
        model=MODEL, messages=ROUND_TRIP, tools=TOOLS, tool_choice="none", max_tokens=1,
        extra_body={"chat_template": TEMPLATE, "add_generation_prompt": False},
    )
    assert out.choices[0].message.tool_calls == []
    assert out.usage.prompt_tokens == len(plain["tokens"])
    follow_up = tool_client.chat.completions.create(model=MODEL, messages=ROUND_TRIP, tools=TOOLS, max_tokens=1)
    assert follow_up.choices[0].finish_reason == "length"


# --------------------------------------------------------------------------- #
# errors
# --------------------------------------------------------------------------- #


def error_of(response) -> tuple[int, str | None, str]:
    body = response.json()["error"]
    return response.status_code, body["param"], body["message"]


def test_auto_without_the_operators_flag_is_a_400(server: Server):
    for body in ({"tool_choice": "auto"}, {}):  # with tools, tool_choice defaults to auto
        status, param, message = error_of(
            server.post("/v1/chat/completions", json={"messages": QUESTION, "tools": TOOLS, **body})
        )
        assert (status, param) == (400, "tool_choice")
        assert message.startswith('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser')


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice",
         "tool_choice names the function 'get_stock', which is not in tools (get_weather, get_time)"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "tools.0.function.parameters", "Input should be a valid dictionary"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
          "tool_choice": "required"}, "tools", "tools (the JSON schema of the calls) is invalid"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
         "cannot be combined with tool_choice required"),
        ({"messages": [ROUND_TRIP[0], {**ROUND_TRIP[1], "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}]}]},
         "messages.1.tool_calls.0.function.arguments", "must be a JSON object, as a string"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(tool_server: Server, body, param, message):
    response = tool_server.post("/v1/chat/completions", json={"messages": QUESTION, "tools": TOOLS, **body})
    assert error_of(response)[:2] == (400, param)
    assert message in error_of(response)[2]


def test_server_keeps_serving_after_bad_tool_requests(tool_server: Server):
    bad = {"messages": QUESTION, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    assert tool_server.post("/v1/chat/completions", json=bad).status_code == 400
    ok = tool_server.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--enable-auto-tool-choice"],
         "--enable-auto-tool-choice needs --tool-call-parser NAME (known: hermes, llama3_json)"),
        (["--tool-call-parser", "mistral"],
         "--tool-call-parser 'mistral' is not a registered tool-call parser; known: hermes, llama3_json"),
    ],
)
def test_serve_refuses_bad_tool_flags_before_loading(capsys: pytest.CaptureFixture, flags, message):
    assert main(["serve", "--port", "0", *flags]) == 2  # before binding or loading anything
    assert f"vframe: error: {message}" in capsys.readouterr().err
