"""The OpenAI wire format: request and response models of the vframe server.

Requests reject unknown fields, as OpenAI's API does, so that a misspelled
parameter is an error rather than silently ignored; a few fields that clients
send but that change nothing here (``user``, ``store``, ``metadata`` ...) are
accepted. vLLM's extensions (``top_k``, ``min_p``, ``ignore_eos``,
``stop_token_ids``, ``prompt_logprobs``, ``return_token_ids``, ``structured_outputs``,
``guided_*`` ...) are accepted with vLLM's meanings; vLLM's extra response fields
(``token_ids``, ``prompt_token_ids``, ``prompt_logprobs``) appear only when asked for.

Types are strict: ``"max_tokens": "8"`` or ``"stream": "false"`` is a 400, not
coerced (an integer is still a valid float: ``"temperature": 1``). A string
holding a lone UTF-16 surrogate (``"\\ud800"``, valid JSON but not Unicode)
is a 400 naming the field. What the server refuses is in the models, so that
``/openapi.json`` does not describe bodies that fail; a rule across fields,
which JSON schema cannot say, is in the field's description.
"""

from __future__ import annotations

import dataclasses

import json
import re
import time
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, WithJsonSchema, field_validator, model_validator
from pydantic_core import PydanticCustomError

from vframe.core.sampling_params import SamplingParams, StructuredOutputsParams
from vframe.entrypoints.openai.errors import APIError
from vframe.errors import InvalidRequestError

TokenIds = list[Annotated[StrictInt, Field(ge=0)]]
_T = TypeVar("_T")
_NonEmpty = Annotated[_T, Field(min_length=1)]  # a string or a list with at least one item
NonEmptyText = _NonEmpty[str]


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _check_union(value: Any, ok: bool, expected: str) -> Any:
    """One clear message instead of one per member of a union type."""
    if not ok:
        raise ValueError(f"must be {expected} (got {type(value).__name__})")
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), strict=True)


class _Body(_Request):
    """A whole request body: every string in it (keys too) must be valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        found = _find_surrogate(data, ())
        if found is not None:
            path, index, char = found
            raise PydanticCustomError(
                "lone_surrogate",
                "{path}: contains a lone UTF-16 surrogate ({char}) at character {index}, which is not "
                "Unicode text; send valid UTF-8",
                {"path": path, "char": f"\\u{ord(char):04x}", "index": index},
            )
        return data


def _find_surrogate(value: Any, path: tuple[str, ...]) -> tuple[str, int, str] | None:
    """(field path, index, character) of the first lone surrogate in a JSON value."""
    if isinstance(value, str):
        match = _SURROGATE.search(value)
        return (".".join(path) or "body", match.start(), match.group()) if match else None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _find_surrogate(key, (*path, "<key>")) or _find_surrogate(item, (*path, str(key)))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _find_surrogate(item, (*path, str(i)))
            if found:
                return found
    return None


_SURROGATE = re.compile("[\\ud800-\\udfff]")


class _Response(BaseModel):
    model_config = ConfigDict(protected_namespaces=())


class PromptLogprob(_Response):
    """vLLM's ``Logprob`` of one token at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


def _on_request(description: str) -> Any:
    """A vLLM extra response field, left out of an answer unless the request asked for it
    (return_token_ids, prompt_logprobs), so that other answers keep OpenAI's shape."""
    return Field(None, description=description, exclude_if=lambda value: value is None)


_PROMPT_LOGPROBS_HELP = (
    "vLLM extension, with prompt_logprobs: per prompt token, token id -> its logprob, rank and text "
    "(the prompt token and the k most likely); null for the first token"
)
_TOKEN_IDS_HELP = "vLLM extension, with return_token_ids: the generated token ids (streamed: this chunk's)"
_PROMPT_TOKEN_IDS_HELP = "vLLM extension, with return_token_ids: the prompt's token ids (streamed: in the first chunk)"


# --------------------------------------------------------------------------- #
# errors
# --------------------------------------------------------------------------- #


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# --------------------------------------------------------------------------- #
# shared request fields
# --------------------------------------------------------------------------- #


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(
        False, description="vLLM extension: with include_usage, every chunk also carries the usage so far"
    )


class JsonSchemaFormat(_Request):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="required")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: free text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(
        None,
        description="required with type json_schema. The schema is compiled within llguidance's parser "
        "limits and a time bound (see docs/serving.md); one it cannot enforce is a 400",
    )

    def to_structured(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise APIError.bad_request(
                "response_format of type json_schema needs json_schema.schema", param="response_format"
            )
        return StructuredOutputsParams(json=self.json_schema.schema_)


_BIAS = {"type": "number", "minimum": -100, "maximum": 100}
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[float, Field(ge=-100, le=100)]],
    WithJsonSchema({"type": "object", "patternProperties": {"^[0-9]+$": _BIAS}, "additionalProperties": False}),
]


class StructuredOutputsBody(_Request):
    """vLLM's ``structured_outputs`` request field: exactly one constraint (vframe's ``StructuredOutputsParams``)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (object or string)")
    regex: NonEmptyText | None = None
    choice: _NonEmpty[list[str]] | None = Field(None, description="the output is exactly one of these")
    grammar: NonEmptyText | None = Field(None, description="a Lark or GBNF grammar")
    json_object: bool | None = Field(None, description="true: any JSON object")
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def to_params(self) -> StructuredOutputsParams:
        try:
            return StructuredOutputsParams(
                json=self.json_,
                regex=self.regex,
                choice=self.choice,
                grammar=self.grammar,
                json_object=self.json_object,
                disable_any_whitespace=self.disable_any_whitespace,
                disable_additional_properties=self.disable_additional_properties,
            )
        except InvalidRequestError as e:
            message = str(e).replace("StructuredOutputsParams", "structured_outputs", 1)
            raise APIError.bad_request(message, param="structured_outputs") from e


# vLLM's older request fields for structured output, each one kind of StructuredOutputsParams
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class LogitsProcessorRef(_Request):
    name: str = Field(min_length=1, description="a name registered in the logits_processor plugin registry")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="constructor arguments")


class _GenerationRequest(_Body):
    """Sampling fields common to completions and chat completions."""

    model: str | None = Field(None, description="served model name; omitted = the served model")
    n: int = Field(1, ge=1, le=128, description="completions to generate per prompt")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="vLLM extension: 0 or -1 disables top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM extension")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="a 64-bit signed integer (as vLLM)")
    stop: str | list[str] | None = Field(None, description="stop strings, not included in the text")
    stop_token_ids: TokenIds | None = Field(None, description="vLLM extension")
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with stream=true")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, description="vLLM extension")
    logit_bias: LogitBias | None = Field(None, description="token id -> bias added to its logit")
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object, or json_schema (structured output)"
    )
    ignore_eos: bool = Field(False, description="vLLM extension: keep going past end-of-sequence")
    min_tokens: int = Field(0, ge=0, description="vLLM extension")
    include_stop_str_in_output: bool = Field(False, description="vLLM extension")
    skip_special_tokens: bool = Field(True, description="vLLM extension")
    spaces_between_special_tokens: bool = Field(True, description="vLLM extension")
    priority: int = Field(0, description="vLLM extension: non-zero needs --scheduling-policy priority")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20,
        description="vLLM extension: also return the logprobs of every prompt token (its own and the k most "
        "likely); not with stream=true",
    )
    return_token_ids: bool | None = Field(
        None, description="vLLM extension: also return the prompt's and each choice's token ids"
    )
    bad_words: list[NonEmptyText] | None = Field(
        None, description="vLLM extension: words never generated (at the start of the text or after a space)"
    )
    allowed_token_ids: _NonEmpty[TokenIds] | None = Field(
        None, description="vLLM extension: only these token ids are generated"
    )
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1,
        description="vLLM extension: keep only the last k prompt tokens (k >= 1, at most the context length); "
        "-1: the last max_model_len",
    )
    structured_outputs: StructuredOutputsBody | None = Field(
        None, description="vLLM extension: one of json, regex, choice, grammar, json_object"
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older name of structured_outputs.json")
    guided_regex: NonEmptyText | None = Field(None, description="vLLM's older name of structured_outputs.regex")
    guided_choice: _NonEmpty[list[str]] | None = Field(
        None, description="vLLM's older name of structured_outputs.choice"
    )
    guided_grammar: NonEmptyText | None = Field(None, description="vLLM's older name of structured_outputs.grammar")
    logits_processors: list[Annotated[str, Field(min_length=1)] | LogitsProcessorRef] | None = Field(
        None,
        description="vLLM extension: logits processors by name, registered by the server's plugins in the "
        "logits_processor registry (a name, or {name, kwargs}); an unknown name is a 400 listing the known ones",
    )
    # Accepted and ignored: they describe the caller, not the generation.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = Field(
        None, description="accepted, no effect: prefix caching is automatic and shared by all requests"
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        ok = value is None or isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(s, str) for s in value)
        )
        return _check_union(value, ok, "a string or a list of strings")

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_not_zero(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be >= 1 (keep that many last prompt tokens) or -1 (the last max_model_len)")
        return value

    def _check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError.bad_request("stream_options is only allowed with stream=true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError.bad_request(
                "prompt_logprobs are not available with stream=true (as in vLLM); use stream=false",
                param="prompt_logprobs",
            )

    @property
    def constraint_field(self) -> str:
        """The field that constrains the output (structured output), named in its errors."""
        return next(iter(self._constraint_fields()), "response_format")

    def _constraint_fields(self) -> list[str]:
        fields = []
        if self.response_format is not None and self.response_format.type != "text":
            fields.append("response_format")
        if self.structured_outputs is not None:
            fields.append("structured_outputs")
        return fields + [name for name in _GUIDED if getattr(self, name) is not None]

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one output constraint of ``response_format``, ``structured_outputs`` or a ``guided_*`` field."""
        fields = self._constraint_fields()
        if len(fields) > 1:
            raise APIError.bad_request(
                f"{fields[0]} and {fields[1]} both constrain the output; give only one of them",
                param=fields[1],
            )
        if not fields:
            return None
        field = fields[0]
        if field == "response_format":
            assert self.response_format is not None
            return self.response_format.to_structured()
        if field == "structured_outputs":
            assert self.structured_outputs is not None
            return self.structured_outputs.to_params()
        return StructuredOutputsParams(**{_GUIDED[field]: getattr(self, field)})

    def _logits_processors(self) -> list[str | tuple[str, dict[str, Any]]] | None:
        if not self.logits_processors:
            return None
        from vframe.plugins import get_registry

        known = get_registry("logits_processor").names()
        specs: list[str | tuple[str, dict[str, Any]]] = []
        for i, ref in enumerate(self.logits_processors):
            name = ref if isinstance(ref, str) else ref.name
            if name not in known:
                raise APIError.bad_request(
                    f"logits_processors.{i}: unknown logits processor {name!r}; this server knows "
                    f"{sorted(known) or 'none'} (registered by its plugins)",
                    param="logits_processors",
                )
            specs.append(name if isinstance(ref, str) else (name, dict(ref.kwargs)))
        return specs

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any] | None
    ) -> SamplingParams:
        """``defaults`` (the model's generation_config, vLLM's rule) fill the sampling
        knobs the request leaves unset, and ``max_tokens`` when it is null."""
        self._check_unsupported()
        knobs = {name: getattr(self, name) for name in _DEFAULTED_KNOBS}
        for name, value in (defaults or {}).items():
            if name in knobs and name not in self.model_fields_set:
                knobs[name] = value
        if max_tokens is None and defaults:
            max_tokens = defaults.get("max_tokens")
        return SamplingParams(
            n=self.n,
            **knobs,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            structured_outputs=self._structured_outputs(),
            logits_processors=self._logits_processors(),
            prompt_logprobs=self.prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            bad_words=self.bad_words,
            allowed_token_ids=self.allowed_token_ids,
            output_kind="delta",
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def include_continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats


# Sampling fields a model's generation_config.json may default (vLLM's list).
_DEFAULTED_KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class PromptTokenUsageInfo(_Response):
    cached_tokens: int | None = Field(None, description="prompt tokens served from the prefix cache")


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = Field(
        None, description="only when the server runs with --enable-prompt-tokens-details"
    )


# --------------------------------------------------------------------------- #
# /v1/completions
# --------------------------------------------------------------------------- #


class CompletionRequest(_GenerationRequest):
    # before prompt, so that a body with prompt_embeds (and an empty prompt) is refused naming it first
    prompt_embeds: None = Field(None, description="not supported yet (only null): prompts are text or token ids")
    prompt: NonEmptyText | _NonEmpty[list[NonEmptyText]] | _NonEmpty[TokenIds] | _NonEmpty[list[_NonEmpty[TokenIds]]] = (
        Field(description="a text, a list of texts, a list of token ids, or a list of those; none of them empty")
    )
    max_tokens: int | None = Field(
        16, ge=0, description="tokens to generate; null = up to the context length; 0 only with echo (the prompt alone)"
    )
    logprobs: int | None = Field(None, ge=0, le=20, description="also return the top-k logprobs of each token")
    echo: bool = Field(
        False, description="prepend the prompt to each choice's text (with logprobs: the prompt tokens' logprobs too)"
    )
    best_of: int | None = Field(
        None, ge=1, le=128,
        description="completions generated per prompt (at least n), of which the n with the highest cumulative "
        "logprob are returned; more than n only without stream",
    )
    suffix: None = Field(None, description="not supported (only null): no fill-in-the-middle rendering")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        ok = isinstance(value, str) or _is_token_ids(value) or (
            isinstance(value, list)
            and (all(isinstance(p, str) for p in value) or all(_is_token_ids(p) for p in value))
        )
        _check_union(value, ok, "a string, a list of strings, a list of token ids or a list of those")
        if not value or (isinstance(value, list) and not all(value)):
            raise ValueError("the decoder prompt cannot be empty: give a non-empty text or token ids")
        return value

    @field_validator("prompt_embeds", mode="before")
    @classmethod
    def _no_prompt_embeds(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(
                "prompt_embeds is not supported yet: vframe's engine takes prompts as text or token ids; "
                "send the prompt's text or token ids in prompt instead"
            )
        return value

    @field_validator("suffix", mode="before")
    @classmethod
    def _no_suffix(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(
                f"suffix={_short_repr(value)} is not supported: suffix is only supported for models with FIM "
                "(fill-in-the-middle) completion rendering, and vframe renders none; leave suffix null"
            )
        return value

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """With ``best_of > n`` the engine returns the ``n`` best when all are done
        (output kind ``final``); ``echo`` with ``logprobs`` asks for the prompt's logprobs too (vLLM's rule)."""
        best_of = self.best_of
        if best_of is not None and best_of < self.n:
            raise APIError.bad_request(
                f"best_of must be greater than or equal to n, got n={self.n} and best_of={best_of}", param="best_of"
            )
        if best_of is not None and best_of > self.n and self.stream:
            raise APIError.bad_request(
                f"best_of={best_of} with n={self.n} cannot be streamed: the best completions are known only when "
                "all are done; use stream=false or best_of=n",
                param="best_of",
            )
        if self.max_tokens == 0 and not self.echo:
            raise APIError.bad_request(
                "max_tokens must be at least 1, got 0 (0 is allowed only with echo=true, which returns the "
                "prompt alone)",
                param="max_tokens",
            )
        # echo alone: the engine prefills the prompt (for its logprobs) and one token, which is dropped
        params = self._sampling_params(1 if self.echo_only else self.max_tokens, self.logprobs, defaults)
        changes: dict[str, Any] = {}
        if best_of is not None and best_of > self.n:
            changes |= {"best_of": best_of, "output_kind": "final"}
        if self.echo and self.logprobs is not None:
            changes["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return dataclasses.replace(params, **changes) if changes else params

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens=0``: each choice is its prompt (and its logprobs), as vLLM answers."""
        return self.echo and self.max_tokens == 0


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, description="vLLM extension: the stop string or token id")
    token_ids: list[int] | None = _on_request(_TOKEN_IDS_HELP)
    prompt_logprobs: PromptLogprobs | None = _on_request(_PROMPT_LOGPROBS_HELP)
    prompt_token_ids: list[int] | None = _on_request(_PROMPT_TOKEN_IDS_HELP)


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# --------------------------------------------------------------------------- #
# /v1/chat/completions
# --------------------------------------------------------------------------- #


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class _Echoed(BaseModel):
    """What a client sends back from an earlier response: other fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)


class FunctionCallParam(_Echoed):
    name: str
    arguments: str | dict[str, Any] = Field(
        "{}", description="a JSON object, as a string (OpenAI's shape) or an object; rendered as an object"
    )


class ToolCallParam(_Echoed):
    """A call the assistant made, in an assistant message of the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(_Echoed):
    """One message. Only text content is supported; other fields a client may
    echo back (``refusal``, ``audio`` ...) are accepted and ignored."""

    role: NonEmptyText = Field(
        description="system, developer, user, assistant, tool, or any other role the chat template renders (as vLLM)"
    )
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = Field(None, description="an assistant message's calls")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


_CHAT_TEMPLATE_HELP = (
    "vLLM extension: a Jinja chat template replacing the model's; a 400 unless the server runs with "
    "--trust-request-chat-template"
)
_TEMPLATE_KWARGS_HELP = (
    "vLLM extension: extra variables for the chat template; not 'tools' (use the tools field), not the "
    "template call's own arguments (tokenize, return_dict ...); 'chat_template' as for the top-level field"
)


class FunctionDefinition(_Request):
    name: NonEmptyText
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = Field(None, description="accepted; forced calls always follow the schema")


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Request):
    name: NonEmptyText


class NamedToolChoice(_Request):
    """``{"type": "function", "function": {"name": ...}}``: call this function."""

    type: Literal["function"] = "function"
    function: FunctionName


_TOOL_CHOICE_HELP = (
    "none: answer in text (the tools are still shown to the template, as vLLM); auto (the default with tools): "
    "the model decides, read by the server's --tool-call-parser (needs --enable-auto-tool-choice); required: "
    "one or more calls, decoded to follow the tools' schemas; a named function: one call of it, decoded to "
    "follow its parameters schema"
)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="tokens to generate; null = up to the context")
    max_tokens: int | None = Field(None, ge=1, description="deprecated name of max_completion_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="needs logprobs=true")
    tools: list[ChatTool] | None = Field(None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description=_TOOL_CHOICE_HELP
    )
    parallel_tool_calls: bool | None = Field(None, description="false: tool_choice required makes one call")
    add_generation_prompt: bool = Field(True, description="vLLM extension; not together with continue_final_message")
    continue_final_message: bool = Field(False, description="vLLM extension")
    chat_template: str | None = Field(None, description=_CHAT_TEMPLATE_HELP)
    chat_template_kwargs: dict[str, Any] | None = Field(None, description=_TEMPLATE_KWARGS_HELP)
    reasoning_effort: str | None = Field(
        None, description="accepted, no effect: vframe's models do not reason before answering"
    )

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> Any:
        ok = value in (None, "none", "auto", "required") or isinstance(value, dict)
        return _check_union(
            value, ok, '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError.bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(self.requested_max_tokens, logprobs, defaults)


def _short_repr(value: Any) -> str:
    """The value as the client wrote it (JSON), shortened."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str = Field(description="a JSON object, as a string")


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="null when the reply is only tool calls")
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _on_request(_TOKEN_IDS_HELP)


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = _on_request(_PROMPT_LOGPROBS_HELP)
    prompt_token_ids: list[int] | None = _on_request(_PROMPT_TOKEN_IDS_HELP)


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    """Part of the call ``index``: the first part has its ``id``, ``type`` and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _on_request(_TOKEN_IDS_HELP)


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = _on_request(_PROMPT_TOKEN_IDS_HELP)


# --------------------------------------------------------------------------- #
# /v1/models, /tokenize, /detokenize
# --------------------------------------------------------------------------- #


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vframe"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Body):
    """Either ``prompt`` (a text) or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = Field(None, description="give exactly one of prompt and messages")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = Field(
        None, description="default: true for a prompt, false for messages (the template has them)"
    )
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = Field(None, description=_CHAT_TEMPLATE_HELP)
    chat_template_kwargs: dict[str, Any] | None = Field(None, description=_TEMPLATE_KWARGS_HELP)
    tools: list[ChatTool] | None = Field(None, description="with messages: tools for the chat template")
    return_token_strs: bool = False


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(_Response):
    prompt: str


class LoadLoRAAdapterRequest(_Body):
    """``POST /v1/load_lora_adapter`` (vLLM's body); both fields are required, checked with a clear message."""

    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(_Body):
    """``POST /v1/unload_lora_adapter`` (vLLM's body)."""

    lora_name: str | None = None
