"""The built-in tool-call parsers on hand-written model replies."""

import json

import pytest

from vframe.entrypoints.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser, ToolParser
from vframe.plugins import get_registry


def calls_of(parser: ToolParser, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parser.extract_tool_calls(text)
    for call in calls:
        assert call.id.startswith("chatcmpl-tool-") and len(call.id) == len("chatcmpl-tool-") + 32
        assert call.type == "function"
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_builtin_parsers_are_registered_as_tool_parser_plugins():
    registry = get_registry("tool_parser")
    assert registry.load("hermes") is HermesToolParser
    assert registry.load("llama3_json") is Llama3JsonToolParser


def test_hermes_reads_each_tool_call_block_and_keeps_the_text_before():
    text = (
        "Let me check.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    )
    assert calls_of(HermesToolParser(), text) == (
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
    )


def test_hermes_accepts_a_missing_closing_tag_and_string_arguments():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}'
    assert calls_of(HermesToolParser(), text) == (None, [("f", {"x": 1})])


@pytest.mark.parametrize(
    "text",
    ["The weather in Paris is sunny.", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'],
)
def test_hermes_leaves_text_without_a_valid_call_as_content(text):
    assert calls_of(HermesToolParser(), text) == (text, [])


def test_llama3_json_reads_a_reply_that_is_a_call():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert calls_of(Llama3JsonToolParser(), text) == (None, [("get_weather", {"city": "Paris"})])


def test_llama3_json_reads_calls_after_the_python_tag_joined_by_semicolons():
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [2]}}'
    assert calls_of(Llama3JsonToolParser(), text) == (None, [("a", {"x": 1}), ("b", {"y": [2]})])


@pytest.mark.parametrize(
    "text", ["Paris is the capital of France.", '{"name": "a", "parameters": {"x": 1}', '{"answer": 42}', '{"name": "a", "parameters": [1]}']
)
def test_llama3_json_leaves_other_text_as_content(text):
    assert calls_of(Llama3JsonToolParser(), text) == (text, [])


@pytest.mark.parametrize(
    ("text", "end"),
    [
        ("Let me check.", 13),
        ("Let me check.\n", 13),  # trailing whitespace may come before a call
        ("Let me check. <tool", 13),  # may grow into <tool_call>
        ("Let me check. <b>", 17),
        ('Let me check.\n<tool_call>{"na', 13),
        ("<tool_call>", 0),
    ],
)
def test_hermes_content_end_holds_back_what_may_become_a_call(text, end):
    assert HermesToolParser().content_end(text) == end


@pytest.mark.parametrize(
    ("text", "end"), [("", 0), ("  ", 0), (" {", 0), ("<|python", 0), ("<|python_tag|>{", 0), (" Paris", 6)]
)
def test_llama3_json_content_end_streams_a_reply_that_cannot_be_a_call(text, end):
    assert Llama3JsonToolParser().content_end(text) == end
