"""Tool calling in ``/v1/chat/completions``: what ``tool_choice`` asks for, and the calls in a reply.

===========  ===============================  ==============================  ===============================
tool_choice  decoding                         the reply                       finish_reason with calls
===========  ===============================  ==============================  ===============================
none         free                             text                            (the engine's)
auto         free                             the server's --tool-call-parser "tool_calls"
                                              reads calls out of the text
required     a JSON array ``[{"name",         each item one call              "tool_calls"
             "parameters"}]``, each item
             one tool's schema
named        the function's parameters        one call of it; its arguments   "stop" (OpenAI's rule)
             schema                           are the text
===========  ===============================  ==============================  ===============================

As in vLLM: ``tool_choice`` defaults to ``auto`` when a request has tools;
``auto`` needs ``vframe serve --enable-auto-tool-choice --tool-call-parser NAME``;
the chat template gets the tools whatever the choice (but none for ``none`` with
``--exclude-tools-when-tool-choice-none``). Call ids are ``chatcmpl-tool-`` and
32 hex digits.

A stream sends text as soon as it is surely content (``ToolParser.content_end``),
named calls' arguments as they are generated, and the other calls whole when the
reply ends, so that the deltas add up to the non-streamed reply.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from vframe.core.sampling_params import StructuredOutputsParams
from vframe.entrypoints.openai.errors import APIError
from vframe.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from vframe.entrypoints.openai.tool_parsers import ToolParser, make_tool_call_id
from vframe.errors import ConfigError

Mode = Literal["none", "auto", "required", "named"]
AUTO_FLAGS = "--enable-auto-tool-choice and --tool-call-parser"
_NO_PARAMETERS = {"type": "object", "properties": {}}
_JSON_VALUES = {"const", "enum", "default", "examples"}  # keywords whose values are data, not schemas


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema that does not say
    ``additionalProperties`` gets ``false``: a forced call holds the properties its
    tool declares and no others, as in vLLM (whose default backend, xgrammar, reads
    schemas so). Clients such as LangChain send pydantic tools without the keyword."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: value if key in _JSON_VALUES else closed_objects(value) for key, value in schema.items()}
    if schema.get("type") == "object" and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


@dataclass(frozen=True)
class ToolCallingConfig:
    """The operator's tool-calling flags of ``vframe serve``."""

    enable_auto_tool_choice: bool = False
    parser: type[ToolParser] | None = None  # the --tool-call-parser class
    exclude_tools_when_tool_choice_none: bool = False

    @classmethod
    def from_flags(
        cls, enable_auto_tool_choice: bool, tool_call_parser: str | None, exclude_tools_when_tool_choice_none: bool
    ) -> ToolCallingConfig:
        """Raises ``ConfigError`` for an unknown parser, or auto tool choice without one."""
        from vframe.plugins import get_registry

        registry = get_registry("tool_parser")
        known = ", ".join(sorted(registry.names())) or "none"
        if enable_auto_tool_choice and not tool_call_parser:
            raise ConfigError(
                f"--enable-auto-tool-choice needs --tool-call-parser NAME (known: {known}): the parser reads "
                "the calls out of the model's text"
            )
        parser = None
        if tool_call_parser:
            if tool_call_parser not in registry:
                raise ConfigError(
                    f"--tool-call-parser {tool_call_parser!r} is not a registered tool-call parser; known: {known} "
                    "(plugins register more: vframe plugins lists them)"
                )
            parser = registry.load(tool_call_parser)
        return cls(enable_auto_tool_choice, parser, exclude_tools_when_tool_choice_none)


@dataclass
class Reply:
    """A finished reply as the API answers it."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None


class ToolChoice:
    """One request's tool calling: the template's tools, the decoding constraint, reading the reply."""

    def __init__(
        self, mode: Mode, tools: list[ChatTool], function_name: str | None = None,
        parser: ToolParser | None = None, template_tools: bool = True, max_calls: int | None = None,
    ) -> None:
        self.mode = mode
        self.tools = tools
        self.function_name = function_name
        self.parser = parser
        self.max_calls = max_calls
        self.template_tools = tool_dicts(tools) if tools and template_tools else None

    @classmethod
    def of(cls, request: ChatCompletionRequest, config: ToolCallingConfig) -> ToolChoice:
        """Raises a 400 for a ``tool_choice`` the request or the server cannot serve."""
        tools, choice = request.tools, request.tool_choice
        if not tools:
            if choice is None or choice == "none" or (tools == [] and choice in ("auto", "required")):
                return cls("none", [])  # OpenAI's rule: required with no tools is none
            raise APIError.bad_request(
                f"tool_choice={_describe(choice)} needs tools: give the functions in tools", param="tool_choice"
            )
        if choice is None:
            choice = "auto"
        if choice == "none":
            return cls("none", tools, template_tools=not config.exclude_tools_when_tool_choice_none)
        if choice == "auto":
            if not config.enable_auto_tool_choice or config.parser is None:
                raise APIError.bad_request(
                    f'"auto" tool choice requires {AUTO_FLAGS} to be set: this server does not read tool calls '
                    'out of free text; send tool_choice "required" or a named function, or ask the operator '
                    f"to start vframe serve with {AUTO_FLAGS} NAME",
                    param="tool_choice",
                )
            parser = config.parser(tool_dicts(tools))
            return cls("auto", tools, parser=parser)
        if choice == "required":
            return cls("required", tools, max_calls=1 if request.parallel_tool_calls is False else None)
        assert isinstance(choice, NamedToolChoice)
        name = choice.function.name
        names = [t.function.name for t in tools]
        if name not in names:
            raise APIError.bad_request(
                f"tool_choice names the function {name!r}, which is not in tools ({', '.join(names)})",
                param="tool_choice",
            )
        return cls("named", tools, function_name=name)

    # ------------------------------------------------------------------ #

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The JSON schema the reply must follow (required and named), else None."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.function_name)
            return StructuredOutputsParams(json=closed_objects(tool.function.parameters or _NO_PARAMETERS))
        if self.mode == "required":
            return StructuredOutputsParams(json=self._required_schema())
        return None

    def _required_schema(self) -> dict[str, Any]:
        """``[{"name": one tool's name, "parameters": its schema}, ...]``; the tools'
        ``$defs`` move to the top, where their ``#/$defs/...`` references point."""
        defs: dict[str, Any] = {}
        variants = []
        for i, tool in enumerate(self.tools):
            parameters = closed_objects(tool.function.parameters or _NO_PARAMETERS)
            for def_name, schema in parameters.pop("$defs", {}).items():
                if defs.setdefault(def_name, schema) != schema:
                    raise APIError.bad_request(
                        f"tools.{i}.function.parameters: $defs.{def_name} differs from another tool's "
                        f"$defs.{def_name}; tool_choice required needs one meaning per name",
                        param="tools",
                    )
            variants.append({
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            })
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
        if self.max_calls is not None:
            schema["maxItems"] = self.max_calls
        if defs:
            schema["$defs"] = defs
        return schema

    # ------------------------------------------------------------------ #

    def reply(self, text: str, finish_reason: str | None) -> Reply:
        """The finished reply: its content, its calls and the finish reason the API reports
        (``None``, a reply the server aborted, stays ``None``)."""
        if self.mode == "none":
            return Reply(text, [], finish_reason)
        if self.mode == "named":
            assert self.function_name is not None
            call = ToolCall(id=make_tool_call_id(), function=FunctionCall(name=self.function_name, arguments=text))
            return Reply(None, [call], finish_reason)
        if self.mode == "required":
            calls = _required_calls(text)
            if calls is None:  # cut short (max_tokens): no valid array
                return Reply(text, [], finish_reason)
            return Reply(None, calls, "tool_calls" if finish_reason == "stop" else finish_reason)
        assert self.parser is not None
        content, parsed = self.parser.extract_tool_calls(text)
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed]
        return Reply(content, calls, "tool_calls" if calls and finish_reason is not None else finish_reason)

    def stream(self) -> ReplyStream:
        return ReplyStream(self)


class ReplyStream:
    """One choice's reply as stream deltas: ``add`` each piece of text, then ``finish``.
    Both return ``(content, tool-call deltas)``; the content is "" when nothing is due."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.text = ""
        self.num_sent = 0  # characters of text sent as content (auto) or as arguments (named)
        self.call_id: str | None = None  # a named call's, once its first delta is sent

    def add(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        mode = self.choice.mode
        if mode == "none":
            return text, []
        self.text += text
        if mode == "named":
            return "", self._named_delta()
        if mode == "auto":
            assert self.choice.parser is not None
            return self._send_content(self.choice.parser.content_end(self.text)), []
        return "", []  # required: the array is read when it is complete

    def finish(self, finish_reason: str | None) -> tuple[str, list[DeltaToolCall], str | None]:
        """The rest of the reply and the finish reason to report."""
        if self.choice.mode == "none":
            return "", [], finish_reason
        reply = self.choice.reply(self.text, finish_reason)
        if self.choice.mode == "named":
            return "", self._named_delta(), reply.finish_reason
        sent = self.text[: self.num_sent]
        content = reply.content or ""
        rest = content[len(sent):] if content.startswith(sent) else ""  # a parser broke content_end's contract
        deltas = [
            DeltaToolCall(
                index=i, id=call.id, type="function",
                function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
            )
            for i, call in enumerate(reply.tool_calls)
        ]
        return rest, deltas, reply.finish_reason

    def _send_content(self, end: int) -> str:
        if end <= self.num_sent:
            return ""
        piece = self.text[self.num_sent:end]
        self.num_sent = end
        return piece

    def _named_delta(self) -> list[DeltaToolCall]:
        """The arguments generated since the last delta; the first delta also names the call."""
        piece = self.text[self.num_sent:]
        self.num_sent = len(self.text)
        if self.call_id is None:
            self.call_id = make_tool_call_id()
            function = DeltaFunctionCall(name=self.choice.function_name, arguments=piece)
            return [DeltaToolCall(index=0, id=self.call_id, type="function", function=function)]
        return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=piece))] if piece else []


def tool_dicts(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """The tools as chat templates and parsers read them: OpenAI's JSON, unset fields left out."""
    return [tool.model_dump(exclude_none=True) for tool in tools]


def _required_calls(text: str) -> list[ToolCall] | None:
    """The calls of a ``required`` reply, ``[{"name": ..., "parameters": {...}}, ...]``, or None."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        if not isinstance(item.get("parameters"), dict):
            return None
        arguments = json.dumps(item["parameters"], ensure_ascii=False)
        calls.append(ToolCall(id=make_tool_call_id(), function=FunctionCall(name=item["name"], arguments=arguments)))
    return calls


def _describe(choice: Any) -> str:
    if isinstance(choice, NamedToolChoice):
        return json.dumps(choice.model_dump())
    return json.dumps(choice)
