"""Tool-call parsers: the tool calls a model wrote in its text, for ``tool_choice="auto"``.

A model trained for tool calling writes its calls in a format of its own; a
parser (vLLM's ``--tool-call-parser NAME``) turns the finished text into the
OpenAI message fields: the text outside the calls (``content``) and the calls
(``tool_calls``). Parsers are plugins of kind ``tool_parser``
(hook ``vframe_register_tool_parsers``); the built-ins:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call
  (Hermes, Qwen2.5, SmolLM3 ...);
* ``llama3_json``: the whole reply is one JSON object ``{"name": ..., "parameters": {...}}``
  (or several joined by ``;``), optionally after ``<|python_tag|>`` (Llama 3.1+).

Text a parser cannot read as calls stays ``content``: a malformed call is never
turned into a wrong one.

Streaming: the server sends, as it comes, the part of the reply that
``content_end`` says is surely content, and reads the calls out of the whole
reply when it ends (``extract_tool_calls``); so a streamed reply adds up to the
non-streamed one.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


def make_tool_call_id() -> str:
    """vLLM's shape: ``chatcmpl-tool-`` and 32 random hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    """One function call: ``arguments`` is a JSON object, as a string (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=make_tool_call_id)
    type: str = "function"


class ToolParser(ABC):
    """Reads tool calls out of a model's finished reply.

    ``tools`` are the request's tools (OpenAI function-tool dicts); a parser may
    use them, e.g. to drop calls to names the request did not offer."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools or []

    @abstractmethod
    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, tool_calls)``: ``content`` is the text outside the calls
        (``None`` when there is none), ``tool_calls`` empty when the text holds no call."""

    def content_end(self, text: str) -> int:
        """How many leading characters of an unfinished reply are surely content,
        whatever follows: what a stream may send before the reply ends. It must be
        a prefix of the ``content`` that ``extract_tool_calls`` returns for any
        continuation. The default, 0, holds the whole reply back until it ends."""
        return 0


def _call_from_json(obj: object, arguments_key: str) -> ToolCall | None:
    """A ToolCall from ``{"name": str, arguments_key: dict}``, or None if ``obj`` is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments already as a string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False))


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (the closing tag
    may be missing at the end of the reply, when generation stopped on it). The
    content is the text before the first block, without trailing whitespace."""

    START = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)

    def content_end(self, text: str) -> int:
        start = text.find(self.START)
        if start < 0:  # hold back an end that may grow into the start tag
            start = len(text) - _partial_suffix(text, self.START)
        return len(text[:start].rstrip())

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.START not in text:
            return text, []
        calls = []
        for body in self._BLOCK.findall(text):
            try:
                call = _call_from_json(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[: text.index(self.START)].rstrip()
        return content or None, calls


class Llama3JsonToolParser(ToolParser):
    """A reply that is a JSON object ``{"name": ..., "parameters": {...}}`` (calls joined
    by ``;``), optionally after ``<|python_tag|>``."""

    PYTHON_TAG = "<|python_tag|>"

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or self.PYTHON_TAG.startswith(body[: len(self.PYTHON_TAG)]):
            return 0  # may still become a call
        return len(text)  # not a call: the whole reply is content

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].strip()
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = _call_from_json(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return None, calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
