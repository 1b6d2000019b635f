"""``POST /v1/responses``: the text subset of OpenAI's Responses API, as vLLM serves it.

``input`` is a string (one user message) or a list of messages (``role`` and ``content``,
a string or ``input_text`` / ``output_text`` parts); ``instructions`` becomes a system
message before them. Both are rendered with the chat template. The answer is one
assistant message item whose ``output_text`` part holds the text; ``status`` is
``incomplete`` (reason ``max_output_tokens``) when the reply was cut by
``max_output_tokens``. With ``stream: true`` the events are OpenAI's:
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` (one per engine step),
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, ``response.completed``.

Responses are not stored: ``previous_response_id``, tools, reasoning and non-text
inputs are refused (unknown fields, 400 naming them); ``store`` and ``metadata`` are
accepted, and ``metadata`` is echoed back.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from vframe.core.sampling_params import SamplingParams
from vframe.entrypoints.openai.errors import REQUEST_ERRORS, APIError
from vframe.entrypoints.openai.protocol import ChatMessage, _Body, _Request
from vframe.entrypoints.openai.serving import (
    Choice,
    Generation,
    ServingContext,
    respond,
    sse,
    sse_error,
)


class InputTextPart(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    # an output_text part sent back from an earlier response carries these too
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputTextPart]
    id: str | None = None  # an output item sent back as input
    status: str | None = None


class ResponsesRequest(_Body):
    model: str | None = Field(None, description="served model name; omitted = the served model")
    input: str | list[InputMessage] = Field(description="a user message, or a list of messages")
    instructions: str | None = Field(None, description="a system message put before the input")
    max_output_tokens: int | None = Field(None, ge=1, description="tokens to generate; null = up to the context")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="null: the model's default, else 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="null: the model's default, else 1")
    stream: bool = False
    store: bool | None = Field(None, description="accepted; vframe keeps no responses (no GET /v1/responses/ID)")
    metadata: dict[str, str] | None = Field(None, description="echoed back in the response")
    user: str | None = None

    def messages(self) -> list[ChatMessage]:
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        for item in items:
            content = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append(ChatMessage(role=item.role, content=content))
        return messages

    def to_sampling_params(self, defaults: dict[str, Any] | None) -> SamplingParams:
        """Fields left null take the model's generation_config defaults (vLLM's rule)."""
        defaults = defaults or {}
        return SamplingParams(
            temperature=self.temperature if self.temperature is not None else defaults.get("temperature", 1.0),
            top_p=self.top_p if self.top_p is not None else defaults.get("top_p", 1.0),
            top_k=defaults.get("top_k", 0),
            min_p=defaults.get("min_p", 0.0),
            repetition_penalty=defaults.get("repetition_penalty", 1.0),
            max_tokens=self.max_output_tokens or defaults.get("max_tokens"),
            output_kind="delta",
        )


async def create_response(ctx: ServingContext, request: ResponsesRequest, raw_request: Request) -> Response:
    arrival = time.perf_counter()
    model, lora_request = ctx.check_model(request.model)
    try:
        params = request.to_sampling_params(ctx.generation_defaults)
    except REQUEST_ERRORS as e:
        raise APIError.from_request_error(e, "input") from e
    prompt = await ctx.prompts.chat(request.messages())
    ctx.check_length(prompt, params.max_tokens, request.max_output_tokens is not None, "input")
    response_id = f"resp_{uuid.uuid4().hex}"
    generation = await ctx.start(response_id, [prompt], params, 0, "input", arrival, lora_request)
    run = _Run(request, model, response_id, generation, params)
    return await respond(raw_request, generation, run, request.stream)


class _Run:
    """One Responses request in flight and how to answer it."""

    def __init__(
        self, request: ResponsesRequest, model: str, response_id: str, generation: Generation, params: SamplingParams
    ) -> None:
        self.request = request
        self.model = model
        self.response_id = response_id
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.generation = generation
        self.params = params
        self.created_at = int(time.time())
        self.choice = Choice()

    async def collect(self) -> Response:
        async with contextlib.aclosing(self.generation.outputs()) as outputs:
            async for _, output in outputs:
                for completion in output.outputs:
                    self.choice.add(completion)
        return JSONResponse(self._response("completed"))

    async def stream(self) -> AsyncIterator[str]:
        sequence = iter(range(1 << 62))

        def event(kind: str, **fields: Any) -> str:
            return sse({"type": kind, "sequence_number": next(sequence), **fields})

        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield event("response.created", response=self._response("in_progress"))
        yield event("response.in_progress", response=self._response("in_progress"))
        yield event("response.output_item.added", output_index=0, item=self._message("in_progress", None))
        yield event("response.content_part.added", **where, part=_text_part(""))
        try:
            async with contextlib.aclosing(self.generation.outputs()) as outputs:
                async for _, output in outputs:
                    for completion in output.outputs:
                        self.choice.add(completion)
                        if completion.text:
                            yield event("response.output_text.delta", **where, delta=completion.text, logprobs=[])
        except Exception as e:  # the engine died mid-stream: tell the client in-band
            yield sse_error(e)
            return
        text = self.choice.text
        yield event("response.output_text.done", **where, text=text, logprobs=[])
        yield event("response.content_part.done", **where, part=_text_part(text))
        yield event("response.output_item.done", output_index=0, item=self._message("completed", text))
        final = self._response("completed")
        yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)

    def _message(self, status: str, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [_text_part(text)]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def _response(self, status: str) -> dict[str, Any]:
        """The response object; ``status`` ``completed`` becomes ``incomplete`` when
        ``max_output_tokens`` cut the reply (or the server aborted it)."""
        incomplete = None
        output: list[dict[str, Any]] = []
        usage = None
        if status == "completed":
            reason = self.choice.finish_reason
            if reason != "stop":
                status = "incomplete"
                incomplete = {"reason": "max_output_tokens" if reason == "length" else "interrupted"}
            output = [self._message(status, self.choice.text)]
            counts = self.generation.usage(self.choice.num_tokens)
            usage = {
                "input_tokens": counts.prompt_tokens,
                "input_tokens_details": {"cached_tokens": sum(self.generation.num_cached_tokens)},
                "output_tokens": counts.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": counts.total_tokens,
            }
        request = self.request
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True,
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "tool_choice": "auto",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": False,
            "metadata": request.metadata or {},
            "usage": usage,
        }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
