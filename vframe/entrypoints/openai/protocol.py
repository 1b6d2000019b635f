"""The OpenAI wire format: request and response models of the vframe server.

Requests reject unknown fields, as OpenAI's API does, so that a misspelled
parameter is an error rather than silently ignored; a few fields that clients
send but that change nothing here (``user``, ``store``, ``metadata`` ...) are
accepted. vLLM's extensions (``top_k``, ``min_p``, ``ignore_eos``,
``stop_token_ids`` ...) are accepted with vLLM's meanings.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from vframe.core.sampling_params import SamplingParams, StructuredOutputsParams
from vframe.entrypoints.openai.errors import APIError

TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _check_union(value: Any, ok: bool, expected: str) -> Any:
    """One clear message instead of one per member of a union type."""
    if not ok:
        raise ValueError(f"must be {expected} (got {type(value).__name__})")
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class _Response(BaseModel):
    model_config = ConfigDict(protected_namespaces=())


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


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

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


class _GenerationRequest(_Request):
    """Sampling fields common to completions and chat completions."""

    model: str | None = Field(None, description="served model name; omitted = the served model")
    n: int = Field(1, ge=1, le=128, description="completions to generate per prompt")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="vLLM extension: 0 or -1 disables top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM extension")
    seed: int | None = None
    stop: str | list[str] | None = Field(None, description="stop strings, not included in the text")
    stop_token_ids: TokenIds | None = Field(None, description="vLLM extension")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, description="vLLM extension")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias added to its logit")
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object, or json_schema (structured output)"
    )
    ignore_eos: bool = Field(False, description="vLLM extension: keep going past end-of-sequence")
    min_tokens: int = Field(0, ge=0, description="vLLM extension")
    include_stop_str_in_output: bool = Field(False, description="vLLM extension")
    skip_special_tokens: bool = Field(True, description="vLLM extension")
    spaces_between_special_tokens: bool = Field(True, description="vLLM extension")
    priority: int = Field(0, description="vLLM extension: needs --scheduling-policy priority")
    # Accepted and ignored: they describe the caller, not the generation.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        ok = value is None or isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(s, str) for s in value)
        )
        return _check_union(value, ok, "a string or a list of strings")

    def _check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError.bad_request("stream_options is only allowed with stream=true", param="stream_options")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self._check_unsupported()
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
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
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            structured_outputs=self.response_format.to_structured() if self.response_format else None,
            output_kind="delta",
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


# --------------------------------------------------------------------------- #
# /v1/completions
# --------------------------------------------------------------------------- #


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="a text, a list of texts, a list of token ids, or a list of those"
    )
    max_tokens: int | None = Field(16, ge=1, description="tokens to generate; null = up to the context length")
    logprobs: int | None = Field(None, ge=0, le=20, description="also return the top-k logprobs of each token")
    echo: bool = Field(False, description="not supported (only false)")
    best_of: int | None = Field(None, ge=1, description="only equal to n (no beam search)")
    suffix: str | None = Field(None, description="not supported (only null)")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        ok = isinstance(value, str) or _is_token_ids(value) or (
            isinstance(value, list)
            and (all(isinstance(p, str) for p in value) or all(_is_token_ids(p) for p in value))
        )
        return _check_union(value, ok, "a string, a list of strings, a list of token ids or a list of those")

    def to_sampling_params(self) -> SamplingParams:
        if self.echo:
            raise APIError.bad_request("echo=true is not supported by vframe yet", param="echo")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError.bad_request(
                f"best_of={self.best_of} is not supported: vframe returns every sequence it generates; "
                "use n instead",
                param="best_of",
            )
        if self.suffix is not None:
            raise APIError.bad_request("suffix is not supported by vframe", param="suffix")
        return self._sampling_params(self.max_tokens, self.logprobs)


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


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message. Only text content is supported; other fields a client may
    echo back (``tool_calls``, ``refusal`` ...) are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="tokens to generate; null = up to the context")
    max_tokens: int | None = Field(None, ge=1, description="deprecated name of max_completion_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(None, description="not supported (only empty)")
    tool_choice: str | dict[str, Any] | None = Field(None, description="only 'none' or 'auto' without tools")
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = Field(True, description="vLLM extension")
    continue_final_message: bool = Field(False, description="vLLM extension")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM extension")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError.bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        if self.tools:
            raise APIError.bad_request("tool calling is not supported by vframe yet", param="tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise APIError.bad_request("tool_choice needs tools, which are not supported", param="tool_choice")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(self.requested_max_tokens, logprobs)


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# --------------------------------------------------------------------------- #
# /v1/models, /tokenize, /detokenize
# --------------------------------------------------------------------------- #


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vframe"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    """Either ``prompt`` (a text) or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(
        None, description="default: true for a prompt, false for messages (the template has them)"
    )
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(_Response):
    prompt: str
