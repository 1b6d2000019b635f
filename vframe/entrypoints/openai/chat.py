"""``POST /v1/chat/completions``: messages rendered with the model's chat template.

A stream starts with one ``{"role": "assistant", "content": ""}`` delta per
choice, then content and tool-call deltas (``tools.py``); the last delta of a
choice carries its ``finish_reason``; with ``stream_options.include_usage`` a
final chunk with no choices carries the usage (and, with
``continuous_usage_stats``, every chunk the usage so far). With vLLM's
``return_token_ids`` the role chunks carry ``prompt_token_ids`` and every choice its
``token_ids``; ``prompt_logprobs`` (not streamed) are on the response.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vframe.core.outputs import Logprob
from vframe.entrypoints.openai.errors import REQUEST_ERRORS, APIError
from vframe.entrypoints.openai.protocol import (
    ChatChunkChoice,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
)
from vframe.entrypoints.openai.serving import (
    SSE_DONE,
    Choice,
    Generation,
    ServingContext,
    clamped_prompt_logprobs,
    finite,
    respond,
    sse,
    sse_error,
    top_logprobs,
)
from vframe.entrypoints.openai.tools import ToolChoice


async def create_chat_completion(
    ctx: ServingContext, request: ChatCompletionRequest, raw_request: Request
) -> Response:
    arrival = time.perf_counter()
    model, lora_request = ctx.check_model(request.model)
    tool_choice = ToolChoice.of(request, ctx.tool_calling)
    try:
        params = request.to_sampling_params(ctx.generation_defaults)
    except REQUEST_ERRORS as e:
        raise APIError.from_request_error(e, "messages") from e
    calls_schema = tool_choice.structured_outputs()
    if calls_schema is not None:
        if params.structured_outputs is not None:
            field = request.constraint_field
            raise APIError.bad_request(
                f"{field} cannot be combined with tool_choice {tool_choice.mode}: both constrain the reply; drop one",
                param=field,
            )
        params.structured_outputs = calls_schema
    prompt = await ctx.prompts.chat(
        request.messages,
        request.add_generation_prompt,
        request.continue_final_message,
        request.chat_template_kwargs,
        request.chat_template,
        tool_choice.template_tools,
    )
    prompt = ctx.truncate(prompt, params)
    explicit = request.requested_max_tokens is not None
    ctx.check_length(prompt, params.max_tokens, explicit, "messages")
    await ctx.prepare(params, "messages", "tools" if calls_schema is not None else request.constraint_field)
    request_id = ctx.new_id("chatcmpl")
    generation = await ctx.start(request_id, [prompt], params, request.priority, "messages", arrival, lora_request)
    run = _Run(request, model, request_id, generation, tool_choice, prompt.token_ids)
    return await respond(raw_request, generation, run, request.stream)


class _Run:
    """One chat request in flight and how to answer it."""

    def __init__(
        self, request: ChatCompletionRequest, model: str, request_id: str, generation: Generation,
        tool_choice: ToolChoice, prompt_token_ids: list[int],
    ) -> None:
        self.request = request
        # vLLM's extras, when asked for: the prompt's token ids (return_token_ids)
        self.prompt_token_ids = prompt_token_ids if request.return_token_ids else None
        self.tool_choice = tool_choice
        self.model = model
        self.request_id = request_id
        self.generation = generation
        self.created = int(time.time())
        self.top_k = (request.top_logprobs or 0) if request.logprobs else None

    async def collect(self) -> Response:
        choices = {j: Choice() for j in range(self.request.n)}
        prompt_logprobs = None
        async with contextlib.aclosing(self.generation.outputs()) as outputs:
            async for _, output in outputs:
                if output.prompt_logprobs is not None:
                    prompt_logprobs = output.prompt_logprobs
                for completion in output.outputs:
                    choices[completion.index].add(completion)
        answers = []
        for index, choice in sorted(choices.items()):
            reply = self.tool_choice.reply(choice.text, choice.finish_reason)
            answers.append(
                ChatCompletionChoice(
                    index=index,
                    message=ChatResponseMessage(content=reply.content, tool_calls=reply.tool_calls),
                    logprobs=self._logprobs(choice.logprobs),
                    finish_reason=reply.finish_reason or "abort",  # none: the server aborted it
                    stop_reason=choice.stop_reason,
                    token_ids=self._token_ids(choice.token_ids),
                )
            )
        response = ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=answers,
            usage=self.generation.usage(sum(c.num_tokens for c in choices.values())),
            prompt_logprobs=clamped_prompt_logprobs(prompt_logprobs),
            prompt_token_ids=self.prompt_token_ids,
        )
        return JSONResponse(response.model_dump())

    async def stream(self) -> AsyncIterator[str]:
        num_tokens = 0
        unfinished = set(range(self.request.n))
        replies = [self.tool_choice.stream() for _ in range(self.request.n)]
        try:
            # one choice per chunk, as vLLM streams (clients that read choices[0] see every delta)
            for j in range(self.request.n):
                role = ChatChunkChoice(index=j, delta=ChatDelta(role="assistant", content=""))
                chunk = self._chunk([role], num_tokens)
                chunk.prompt_token_ids = self.prompt_token_ids
                yield sse(chunk)
            async with contextlib.aclosing(self.generation.outputs()) as outputs:
                async for _, output in outputs:
                    chunk_choices = []
                    for completion in output.outputs:
                        num_tokens += len(completion.token_ids)
                        reply = replies[completion.index]
                        content, tool_calls = reply.add(completion.text)
                        finish_reason = completion.finish_reason
                        if finish_reason is not None:
                            unfinished.discard(completion.index)
                            rest, more_calls, finish_reason = reply.finish(finish_reason)
                            content, tool_calls = content + rest, tool_calls + more_calls
                        asked_ids = self.request.return_token_ids and completion.token_ids
                        if not (content or tool_calls or finish_reason or completion.logprobs or asked_ids):
                            continue
                        pairs = zip(completion.token_ids, completion.logprobs or [])
                        chunk_choices.append(
                            ChatChunkChoice(
                                index=completion.index,
                                delta=ChatDelta(
                                    content=None if tool_calls and not content else content,
                                    tool_calls=tool_calls or None,
                                ),
                                logprobs=self._logprobs(pairs),
                                finish_reason=finish_reason,
                                stop_reason=completion.stop_reason,
                                token_ids=self._token_ids(completion.token_ids),
                            )
                        )
                    for choice in chunk_choices:
                        yield sse(self._chunk([choice], num_tokens))
            if self.generation.aborted:
                for i in sorted(unfinished):
                    content, tool_calls, _ = replies[i].finish(None)  # what was held back for tool calls
                    delta = ChatDelta(content=content or None, tool_calls=tool_calls or None)
                    yield sse(self._chunk([ChatChunkChoice(index=i, delta=delta, finish_reason="abort")]))
        except Exception as e:  # the engine died mid-stream: tell the client in-band
            yield sse_error(e)
        else:
            if self.request.include_usage:
                chunk = self._chunk([])
                chunk.usage = self.generation.usage(num_tokens)
                yield sse(chunk)
        yield SSE_DONE

    def _chunk(self, choices: list[ChatChunkChoice], num_tokens: int | None = None) -> ChatCompletionChunk:
        """``num_tokens`` generated so far: the chunk's usage with ``continuous_usage_stats``."""
        usage = None
        if num_tokens is not None and self.request.include_continuous_usage:
            usage = self.generation.usage(num_tokens)
        return ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _token_ids(self, token_ids: list[int]) -> list[int] | None:
        return list(token_ids) if self.request.return_token_ids else None

    def _logprobs(self, pairs: Iterable[tuple[int, dict[int, Logprob]]]) -> ChatLogprobs | None:
        if self.top_k is None:
            return None
        content = []
        for token_id, entry in pairs:
            chosen = entry[token_id]
            content.append(
                ChatTokenLogprob(
                    **_token(chosen),
                    top_logprobs=[ChatTopLogprob(**_token(lp)) for _, lp in top_logprobs(entry, self.top_k)],
                )
            )
        return ChatLogprobs(content=content)


def _token(lp: Logprob) -> dict:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": finite(lp.logprob), "bytes": list(token.encode("utf-8"))}
