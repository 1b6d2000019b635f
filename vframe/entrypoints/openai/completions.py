"""``POST /v1/completions``: text or token-id prompts, streamed or not.

Choice ``i * n + j`` is the ``j``-th sequence of the ``i``-th prompt, as in OpenAI's API.
With ``echo`` each choice's text starts with its prompt (streamed: in its first chunk),
and with ``logprobs`` too its logprobs start with the prompt tokens' (the first one
``null``), as vLLM answers; ``echo`` with ``max_tokens=0`` answers the prompt alone.
vLLM's ``return_token_ids`` and ``prompt_logprobs`` put ``token_ids``, ``prompt_token_ids``
(streamed: in a choice's first chunk) and ``prompt_logprobs`` on each choice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vframe.core.outputs import CompletionOutput
from vframe.entrypoints.openai.errors import REQUEST_ERRORS, APIError
from vframe.entrypoints.openai.prompts import Prompt
from vframe.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
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


async def create_completion(ctx: ServingContext, request: CompletionRequest, raw_request: Request) -> Response:
    arrival = time.perf_counter()
    model, lora_request = ctx.check_model(request.model)
    try:
        params = request.to_sampling_params(ctx.generation_defaults)
    except REQUEST_ERRORS as e:
        raise APIError.from_request_error(e, "prompt") from e
    prompts = [ctx.truncate(prompt, params) for prompt in await _prompts(ctx, request.prompt)]
    explicit = "max_tokens" in request.model_fields_set
    for prompt in prompts:
        ctx.check_length(prompt, params.max_tokens, explicit, "prompt")
    await ctx.prepare(params, "prompt", request.constraint_field)
    request_id = ctx.new_id("cmpl")
    generation = await ctx.start(request_id, prompts, params, request.priority, "prompt", arrival, lora_request)
    echoed = [_prompt_text(ctx, prompt) for prompt in prompts] if request.echo else None
    run = _Run(request, model, request_id, generation, prompts, echoed, ctx.engine.tokenizer)
    return await respond(raw_request, generation, run, request.stream)


async def _prompts(ctx: ServingContext, prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    """The validated ``prompt`` field (never empty) as prompts; texts tokenized off the loop."""
    if isinstance(prompt, str):
        return await ctx.prompts.texts([prompt])
    if isinstance(prompt[0], int):
        return [Prompt(None, list(prompt))]  # type: ignore[arg-type]
    if isinstance(prompt[0], str):
        return await ctx.prompts.texts(prompt)  # type: ignore[arg-type]
    return [Prompt(None, list(p)) for p in prompt]  # type: ignore[union-attr]


def _prompt_text(ctx: ServingContext, prompt: Prompt) -> str:
    if prompt.text is not None:
        return prompt.text
    return ctx.engine.tokenizer.decode(prompt.token_ids)


class _Run:
    """One completion request in flight and how to answer it."""

    def __init__(
        self,
        request: CompletionRequest,
        model: str,
        request_id: str,
        generation: Generation,
        prompts: list[Prompt],
        echoed: list[str] | None,
        tokenizer: Any,
    ) -> None:
        self.request = request
        self.model = model
        self.request_id = request_id
        self.generation = generation
        self.prompts = prompts
        self.num_prompts = len(prompts)
        self.echoed = echoed  # per prompt, its text when echo is on
        self.echo_only = request.echo_only  # the one token the engine generated is not answered
        self.tokenizer = tokenizer
        self.created = int(time.time())
        # per prompt, its tokens' logprobs (echo with logprobs), filled by the engine as it prefills
        self.prompt_logprobs: dict[int, list] = {}

    def _echo(self, prompt_index: int) -> tuple[str, list]:
        """The text and ``(token id, entry)`` pairs to put before a choice's first output."""
        if self.echoed is None:
            return "", []
        entries = self.prompt_logprobs.get(prompt_index)
        pairs = list(zip(self.prompts[prompt_index].token_ids, entries)) if entries is not None else []
        return self.echoed[prompt_index], pairs

    async def collect(self) -> Response:
        n = self.request.n
        choices = {i * n + j: Choice() for i in range(self.num_prompts) for j in range(n)}
        async with contextlib.aclosing(self.generation.outputs()) as outputs:
            async for i, output in outputs:
                if output.prompt_logprobs is not None:
                    self.prompt_logprobs[i] = output.prompt_logprobs
                for completion in output.outputs:
                    choices[i * n + completion.index].add(completion)
        echoes = {index: self._echo(index // n) for index in choices}
        if self.echo_only:
            choices = {index: _without_output(choice) for index, choice in choices.items()}
        response = CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[
                CompletionChoice(
                    index=index,
                    text=echoes[index][0] + choice.text,
                    logprobs=self._logprobs(echoes[index][1] + choice.logprobs, 0),
                    finish_reason=choice.finish_reason or "abort",  # none: the server aborted it
                    stop_reason=choice.stop_reason,
                    **self._extras(index // n, choice.token_ids),
                )
                for index, choice in sorted(choices.items())
            ],
            usage=self._usage(sum(c.num_tokens for c in choices.values())),
        )
        return JSONResponse(response.model_dump())

    async def stream(self) -> AsyncIterator[str]:
        n = self.request.n
        num_tokens = 0
        offsets: dict[int, int] = {}  # choice -> characters sent, for text_offset
        unfinished = set(range(self.num_prompts * n))
        try:
            async with contextlib.aclosing(self.generation.outputs()) as outputs:
                async for i, output in outputs:
                    if output.prompt_logprobs is not None:
                        self.prompt_logprobs[i] = output.prompt_logprobs
                    chunk_choices = []
                    for completion in output.outputs:
                        index = i * n + completion.index
                        if self.echo_only:
                            completion = _without_output(completion)
                        num_tokens += len(completion.token_ids)
                        asked_ids = self.request.return_token_ids and completion.token_ids
                        if not (completion.text or completion.finish_reason or completion.logprobs or asked_ids):
                            continue
                        first = index not in offsets
                        echo_text, echo_pairs = self._echo(i) if first else ("", [])
                        offset = offsets.get(index, 0)
                        text = echo_text + completion.text
                        logprobs = self._logprobs(echo_pairs + _pairs(completion), offset)
                        offsets[index] = offset + len(text)
                        if completion.finish_reason is not None:
                            unfinished.discard(index)
                        chunk_choices.append(
                            CompletionChoice(
                                index=index,
                                text=text,
                                logprobs=logprobs,
                                finish_reason=completion.finish_reason,
                                stop_reason=completion.stop_reason,
                                **self._extras(i, completion.token_ids, with_prompt=first),
                            )
                        )
                    usage = self._usage(num_tokens) if self.request.include_continuous_usage else None
                    for choice in chunk_choices:  # one choice per chunk, as vLLM streams
                        yield sse(self._chunk([choice], usage=usage))
            if self.generation.aborted:
                for i in sorted(unfinished):
                    yield sse(self._chunk([CompletionChoice(index=i, text="", finish_reason="abort")]))
        except Exception as e:  # the engine died mid-stream: tell the client in-band
            yield sse_error(e)
        else:
            if self.request.include_usage:
                yield sse(self._chunk([], usage=self._usage(num_tokens)))
        yield SSE_DONE

    def _extras(self, prompt_index: int, token_ids: list[int], with_prompt: bool = True) -> dict[str, Any]:
        """vLLM's extra choice fields the request asked for: its token ids (return_token_ids)
        and its prompt's logprobs (prompt_logprobs, never streamed)."""
        extras: dict[str, Any] = {}
        if self.request.return_token_ids:
            extras["token_ids"] = list(token_ids)
            if with_prompt:
                extras["prompt_token_ids"] = self.prompts[prompt_index].token_ids
        if self.request.prompt_logprobs is not None:
            extras["prompt_logprobs"] = clamped_prompt_logprobs(self.prompt_logprobs.get(prompt_index))
        return extras

    def _chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _usage(self, num_generated: int) -> UsageInfo:
        return self.generation.usage(num_generated)

    def _logprobs(self, pairs: list, text_offset: int) -> CompletionLogprobs | None:
        k = self.request.logprobs
        if k is None:
            return None
        result = CompletionLogprobs()
        for token_id, entry in pairs:
            if entry is None:  # the first prompt token (echo): nothing before it to predict it
                token = self.tokenizer.decode([token_id])
                result.tokens.append(token)
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                result.text_offset.append(text_offset)
                text_offset += len(token)
                continue
            chosen = entry[token_id]
            token = chosen.decoded_token or ""
            result.tokens.append(token)
            result.token_logprobs.append(finite(chosen.logprob))
            # the sampled token first, then the k most likely (vLLM's and OpenAI's shape:
            # logprobs=0 gives the sampled token alone)
            top = {token: finite(chosen.logprob)}
            top.update({(lp.decoded_token or ""): finite(lp.logprob) for _, lp in top_logprobs(entry, k)})
            result.top_logprobs.append(top)
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result


def _without_output(output: CompletionOutput | Choice) -> CompletionOutput | Choice:
    """``output`` with its generated text, tokens and logprobs dropped (echo alone)."""
    if isinstance(output, Choice):
        return dataclasses.replace(output, text_parts=[], token_ids=[], logprobs=[])
    return dataclasses.replace(output, text="", token_ids=[], logprobs=None)


def _pairs(completion: CompletionOutput) -> list:
    if completion.logprobs is None:
        return []
    return list(zip(completion.token_ids, completion.logprobs))
