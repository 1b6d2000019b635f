"""What the completion and chat handlers share: the model check, the
context-length check, preparing sampling parameters, starting engine requests
and reading their outputs.

Prompts are built off the event loop (``prompts.py``); a request's grammar is
compiled off the event loop and off the engine thread
(``AsyncLLMEngine.compile_structured_output``): the engine thread only ever
sees token ids and compiled grammars.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from vframe.core.async_engine import AsyncLLMEngine, EngineDeadError, RequestAbortedError, RequestStream
from vframe.core.outputs import CompletionOutput, Logprob, RequestOutput
from vframe.core.sampling_params import SamplingParams
from vframe.entrypoints.openai.errors import REQUEST_ERRORS, APIError, error_body
from vframe.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from vframe.entrypoints.openai.models import ServingModels
from vframe.entrypoints.openai.prompts import Prompt, PromptBuilder
from vframe.entrypoints.openai.protocol import PromptLogprob, PromptLogprobs, PromptTokenUsageInfo, UsageInfo
from vframe.entrypoints.openai.tools import ToolCallingConfig
from vframe.errors import ConfigError, PluginError
from vframe.lora.request import LoRARequest

# How a compile error names the request field the constraint came from: (pattern of the
# engine's name, the field's). A guided_* field holds the constraint itself.
_GUIDED_PATTERN = r"^(response_format\.json_schema|structured_outputs(\.\w+)?)\b"
_CONSTRAINT_NAMES = {
    "tools": (r"^(response_format\.json_schema|structured_outputs)\b", "tools (the JSON schema of the calls)"),
    "structured_outputs": (r"^response_format\.json_schema\b", "structured_outputs.json"),
}

# Compiling a response_format grammar (llguidance, bounded by its parser limits)
# longer than this is refused; the compile then ends in its worker thread.
GRAMMAR_TIMEOUT_S = 10.0


class ServingContext:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        models: ServingModels,
        metrics: ServerMetrics,
        trust_request_chat_template: bool = False,
        enable_prompt_tokens_details: bool = False,
        tool_calling: ToolCallingConfig | None = None,
    ) -> None:
        if engine.tokenizer is None:
            raise ConfigError("the OpenAI server needs a tokenizer; do not set skip_tokenizer_init")
        self.engine = engine
        self.models = models
        self.served_model_name = models.base_model_name
        self.metrics = metrics
        self.max_model_len = engine.max_model_len
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.tool_calling = tool_calling or ToolCallingConfig()
        # Sampling defaults from the model's generation_config (setting generation_config).
        self.generation_defaults = engine.generation_defaults
        self.prompts = PromptBuilder(engine.tokenizer, engine.max_model_len, trust_request_chat_template)

    # ------------------------------------------------------------------ #
    # input
    # ------------------------------------------------------------------ #

    def check_model(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """The model name to answer with and the LoRA adapter ``model`` selects
        (``None``: the base model); 404 for a name this server does not serve."""
        lora = self.models.resolve(model)
        return (self.served_model_name if lora is None else lora.lora_name), lora

    async def prepare(
        self, params: SamplingParams, prompt_field: str, constraint_field: str = "response_format"
    ) -> None:
        """Compile the request's output constraint into ``params`` in a worker thread, with
        a time bound. ``constraint_field``: the field it came from (``response_format``,
        ``structured_outputs``, a ``guided_*`` field, or ``tools`` for a tool_choice
        that forces calls), named in errors."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.wait_for(self.engine.compile_structured_output(params), GRAMMAR_TIMEOUT_S)
        except asyncio.TimeoutError as e:  # TimeoutError itself only from Python 3.11
            raise APIError.bad_request(
                f"{constraint_field}: compiling its grammar took longer than {GRAMMAR_TIMEOUT_S:g} s; "
                "simplify the schema",
                param=constraint_field,
            ) from e
        except REQUEST_ERRORS as e:
            error = APIError.from_request_error(e, "response_format")
            if constraint_field == "response_format" or error.param != "response_format":
                raise error from e
            pattern, name = _CONSTRAINT_NAMES.get(constraint_field, (_GUIDED_PATTERN, constraint_field))
            message = re.sub(pattern, name, error.message)
            raise APIError.bad_request(message, param=constraint_field) from e

    def truncate(self, prompt: Prompt, params: SamplingParams) -> Prompt:
        """``prompt`` cut to its last ``truncate_prompt_tokens`` tokens (vLLM's rule), so that
        the length check, usage and returned prompt token ids see what the engine runs."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return prompt
        if keep > self.max_model_len:
            raise APIError.bad_request(
                f"truncate_prompt_tokens={keep} is greater than this model's maximum context length "
                f"({self.max_model_len}); give at most {self.max_model_len}, or -1 for the context length",
                param="truncate_prompt_tokens",
            )
        keep = self.max_model_len if keep == -1 else keep
        if len(prompt.token_ids) <= keep:
            return prompt
        return Prompt(None, prompt.token_ids[-keep:])

    def check_length(self, prompt: Prompt, max_tokens: int | None, explicit: bool, prompt_field: str) -> None:
        """OpenAI's rule: the prompt plus an explicitly requested ``max_tokens``
        must fit the context; a default ``max_tokens`` is capped instead."""
        n = len(prompt.token_ids)
        wanted = n + (max_tokens if explicit and max_tokens is not None else 1)
        if wanted <= self.max_model_len:
            return
        asked = f" plus max_tokens={max_tokens}" if explicit and max_tokens is not None else ""
        raise APIError.bad_request(
            f"This model's maximum context length is {self.max_model_len} tokens, but the request "
            f"needs {wanted} ({n} in the prompt{asked}); shorten the prompt"
            + (" or lower max_tokens" if asked else ""),
            param=prompt_field if not asked or n >= self.max_model_len else "max_tokens",
            code="context_length_exceeded",
        )

    # ------------------------------------------------------------------ #
    # running
    # ------------------------------------------------------------------ #

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def start(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        priority: int,
        prompt_field: str,
        arrival: float,
        lora_request: LoRARequest | None = None,
    ) -> Generation:
        """One engine request per prompt, with ``lora_request``'s adapter if given; all or none are started."""
        streams: list[RequestStream] = []
        self.models.check_served(lora_request)
        try:
            for i, prompt in enumerate(prompts):
                engine_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                engine_prompt = {"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}
                streams.append(
                    await self.engine.add_request(engine_id, engine_prompt, params, priority, lora_request)
                )
        except BaseException as e:
            for stream in streams:
                stream.abort()
            if isinstance(e, (*REQUEST_ERRORS, PluginError)):
                raise APIError.from_request_error(e, prompt_field) from e
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e)) from e
            raise
        return Generation(self.metrics, streams, prompts, params.n, arrival, self.enable_prompt_tokens_details)


class Generation:
    """The engine requests of one API request (one per prompt) and their metrics.

    ``close()`` must run however the request ends, even if ``outputs()`` was never
    iterated (a client that leaves before the first byte): it aborts what still
    runs, which frees its KV blocks, and records the outcome."""

    def __init__(
        self,
        metrics: ServerMetrics,
        streams: list[RequestStream],
        prompts: list[Prompt],
        n: int,
        arrival: float,
        prompt_tokens_details: bool = False,
    ) -> None:
        self.streams = streams
        self.n = n
        self.timers = [RequestTimer(metrics, arrival, len(p.token_ids)) for p in prompts]
        self.num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        self.prompt_tokens_details = prompt_tokens_details
        self.num_cached_tokens = [0] * len(prompts)  # per prompt, from its outputs
        self.aborted = False  # by the server (shutdown): the answer so far is sent, ending in "abort"
        self._closed = False

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(prompt index, RequestOutput)`` as they come, every prompt's stream merged.
        Ends early, with ``aborted`` set, if the server aborts the request."""
        try:
            async with contextlib.aclosing(_merge(self.streams)) as merged:
                async for i, output in merged:
                    self.timers[i].observe(output)
                    self.num_cached_tokens[i] = max(self.num_cached_tokens[i], output.num_cached_tokens)
                    _raise_if_failed(output)
                    yield i, output
        except RequestAbortedError:
            self.aborted = True

    def usage(self, num_generated: int) -> UsageInfo:
        details = None
        if self.prompt_tokens_details:
            details = PromptTokenUsageInfo(cached_tokens=sum(self.num_cached_tokens))
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=num_generated,
            total_tokens=self.num_prompt_tokens + num_generated,
            prompt_tokens_details=details,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for stream, timer in zip(self.streams, self.timers):
            aborted = self.aborted or not stream.finished
            stream.abort()
            timer.finish(self.n, aborted)


def _raise_if_failed(output: RequestOutput) -> None:
    """A completion the engine gave up on (``finish_reason="error"``) fails the whole
    HTTP request: 400 when the request's own constraints caused it, else 500. Its
    siblings are aborted when the response closes; the engine serves everyone else."""
    for completion in output.outputs:
        if completion.finish_reason == "error":
            error = completion.error
            client = error is not None and error.caused_by_request
            raise APIError(
                400 if client else 500,
                f"generation failed: {error or 'the engine gave up on this request'}",
                code="invalid_generation_constraints" if client else "generation_failed",
            )


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that runs ``on_close`` when it ends for any reason:
    done, client gone (the body iterator may never have started), or cancelled."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


class Answer(Protocol):
    """An API request in flight: its answer as server-sent events or as one response."""

    def stream(self) -> AsyncIterator[str]: ...

    async def collect(self) -> Response: ...


async def respond(raw_request: Request, generation: Generation, run: Answer, streaming: bool) -> Response:
    """``run``'s answer, streamed or whole; ``generation`` is closed when the
    answer ends, however it ends (done, client gone, cancelled)."""
    if streaming:
        return ClosingStreamingResponse(run.stream(), on_close=generation.close)
    try:
        return await until_disconnected(raw_request, run.collect())
    finally:
        generation.close()


async def until_disconnected(raw_request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work`` unless the client goes away first, in which case cancel it
    (which aborts its engine requests) and answer into the void."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        return await task
    return Response(status_code=499)  # client closed the connection; nobody reads this


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass
class Choice:
    """One sequence's accumulated output, gathered from delta outputs."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, dict[int, Logprob]]] = field(default_factory=list)  # (token id, entry)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, completion: CompletionOutput) -> None:
        self.text_parts.append(completion.text)
        self.token_ids.extend(completion.token_ids)
        if completion.logprobs is not None:
            self.logprobs.extend(zip(completion.token_ids, completion.logprobs))
        if completion.finish_reason is not None:
            self.finish_reason = completion.finish_reason
            self.stop_reason = completion.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def finite(logprob: float) -> float:
    """JSON has no -inf: an impossible token gets vLLM's floor instead."""
    return max(logprob, -9999.0)


def clamped_prompt_logprobs(entries: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
    """A request output's prompt logprobs as vLLM answers them (``-inf`` clamped)."""
    if entries is None:
        return None
    return [
        None if entry is None else {
            token_id: PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
            for token_id, lp in entry.items()
        }
        for entry in entries
    ]


def top_logprobs(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely tokens of one position, most likely first."""
    ranked = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    return sorted(ranked, key=lambda item: item[1].rank)[:k]


def sse(payload: BaseModel | dict[str, Any]) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(error: Exception) -> str:
    """An error after the response started: OpenAI clients raise it from the stream.
    An ``APIError`` (a failed completion) keeps its own message, type and code."""
    if isinstance(error, APIError):
        return sse(error.body())
    return sse(error_body(500, f"generation failed: {error}"))
