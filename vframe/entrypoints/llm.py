"""``LLM``: the offline API, with vLLM's names and meanings."""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from vframe.core.config import EngineConfig
from vframe.core.engine import LLMEngine, PromptType
from vframe.core.outputs import CompletionOutput, Logprob, RequestOutput
from vframe.core.pooling_outputs import (
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from vframe.core.pooling_params import PoolingParams
from vframe.core.sample.beam_search import BeamSearchOutput, BeamSearchSequence, beam_search
from vframe.core.sampling_params import BeamSearchParams, SamplingParams
from vframe.entrypoints.chat_utils import tool_call_arguments
from vframe.errors import InvalidRequestError
from vframe.lora.request import LoRARequest

if TYPE_CHECKING:
    from vframe.entrypoints.openai.metrics import ServerMetrics
    from vframe.v1.metrics.reader import Metric

logger = logging.getLogger(__name__)

Message = dict[str, Any]
# The server's series that LLM.get_metrics() leaves out: LLM.generate hears of a
# request only when it finishes (so no first-token time) and serves no HTTP.
_NOT_MEASURED_OFFLINE = frozenset(
    {"vframe:http_requests", "vframe:time_to_first_token_seconds", "vframe:time_per_output_token_seconds"}
)


class LLM:
    """Generate text from prompts with an in-process engine.

    ``LLM()`` serves the embedded SmolLM2-135M-Instruct; ``LLM(model=path)``
    takes a GGUF file or a Hugging Face directory. Every engine setting is a
    keyword argument named as in vLLM (``max_num_seqs``, ``block_size``,
    ``enable_prefix_caching``, ``attention_backend`` ...), see
    ``docs/configuration.md``; ``config_file=`` reads them from YAML or TOML.
    """

    def __init__(self, model: str | None = None, *, config_file: str | None = None, **kwargs: Any) -> None:
        if model is not None:
            kwargs["model"] = model
        self.llm_engine = LLMEngine(EngineConfig.from_sources(config_file=config_file, **kwargs))
        self._metrics: ServerMetrics | None = None  # the series of get_metrics(), made on first use
        # Plugins hear vframe_engine_shutdown when the LLM is dropped or at exit.
        self._finalizer = weakref.finalize(self, self.llm_engine.shutdown)

    def shutdown(self) -> None:
        """Abort what is still running and tell plugins the engine is done."""
        self._finalizer()

    @property
    def config(self) -> EngineConfig:
        return self.llm_engine.config

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Use ``tokenizer`` (a Hugging Face tokenizer of the same vocabulary) to
        tokenize text prompts, render chats and detokenize outputs, as vLLM's
        ``set_tokenizer``. Structured outputs and plugins keep the one the engine loaded
        (their token tables are built from it)."""
        if not callable(tokenizer) or not hasattr(tokenizer, "decode"):
            raise InvalidRequestError(
                "set_tokenizer() needs a Hugging Face tokenizer (callable, with decode), got "
                f"{type(tokenizer).__name__}"
            )
        engine = self.llm_engine
        if len(tokenizer) > engine.vocab_size:
            raise InvalidRequestError(
                f"set_tokenizer(): the tokenizer has {len(tokenizer)} tokens, more than the model's vocabulary "
                f"({engine.vocab_size}); use a tokenizer of this model"
            )
        engine.tokenizer = tokenizer
        engine.output_processor.tokenizer = tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given no ``sampling_params``: the
        model's ``generation_config.json`` defaults (setting ``generation_config``)."""
        return self.llm_engine.get_default_sampling_params()

    # ------------------------------------------------------------------ #

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.
        ``lora_request``: one adapter for every prompt, or one (or ``None``) per
        prompt (needs ``enable_lora=True``). ``prompt_token_ids``: vLLM's legacy
        keyword, one list of token ids or a list of them, instead of ``prompts``."""
        if prompt_token_ids is not None:
            if prompts is not None:
                raise InvalidRequestError("pass prompts or prompt_token_ids to generate(), not both")
            ids = prompt_token_ids
            prompts = [{"prompt_token_ids": ids}] if ids and isinstance(ids[0], int) else [
                {"prompt_token_ids": list(p)} for p in ids
            ]
        elif prompts is None:
            raise InvalidRequestError("generate() needs prompts (or vLLM's legacy prompt_token_ids=)")
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = self._per_prompt(sampling_params, len(prompts), "sampling_params")
        priorities = self._per_prompt(priority, len(prompts), "priority", default=0)
        loras = _per_prompt_lora(lora_request, len(prompts))
        if any(p.use_beam_search for p in params):
            return self._generate_with_beam_search(prompts, params, priorities, loras, use_tqdm)
        return self._run(list(zip(prompts, params, priorities, loras)), use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt (transformers' ``num_beams`` semantics, see
        ``vframe/core/sample/beam_search.py``); per prompt the ``beam_width`` best
        sequences, best first, whose ``tokens`` and ``text`` include the prompt (as in vLLM).
        ``concurrency_limit``: at most this many prompts searched at once (vLLM's meaning;
        ``None``: all of them)."""
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise InvalidRequestError(
                f"concurrency_limit must be a positive integer or None, got {concurrency_limit!r}"
            )
        engine = self.llm_engine
        token_prompts = [engine.tokenize_prompt(p)[1] for p in _as_prompt_list(prompts)]
        chunk = concurrency_limit or max(1, len(token_prompts))
        results = [
            beams
            for start in range(0, len(token_prompts), chunk)
            for beams in self._beam_search(
                token_prompts[start : start + chunk], params.beam_width, params.max_tokens, params.ignore_eos,
                params.length_penalty, params.early_stopping, lora_request,
            )
        ]
        tokenizer = self.get_tokenizer()
        for beams in results:
            for beam in beams:
                beam.text = tokenizer.decode(beam.tokens) if tokenizer is not None else None
        return [BeamSearchOutput(sequences=beams) for beams in results]

    def _beam_search(
        self,
        token_prompts: list[list[int]],
        beam_width: int,
        max_tokens: int,
        ignore_eos: bool,
        length_penalty: float,
        early_stopping: bool | str,
        lora_request: LoRARequest | None = None,
    ) -> list[list[BeamSearchSequence]]:
        engine = self.llm_engine
        # A beam cannot grow past max_model_len; a prompt that leaves no room fails in generate().
        max_tokens = max(1, min(max_tokens, engine.max_model_len - max(len(t) for t in token_prompts)))

        def step(beams: list[list[int]], k: int) -> list[dict[int, Logprob]]:
            params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=k, ignore_eos=True, detokenize=False)
            outputs = self.generate(
                [{"prompt_token_ids": b} for b in beams], params, use_tqdm=False, lora_request=lora_request
            )
            return [out.outputs[0].logprobs[0] for out in outputs]

        eos = set() if ignore_eos else engine.eos_token_ids
        return beam_search(token_prompts, beam_width, max_tokens, eos, length_penalty, early_stopping, step)

    def _generate_with_beam_search(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        priorities: list[int],
        loras: list[LoRARequest | None],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """``SamplingParams(use_beam_search=True)``: the ``n`` best of ``best_of`` (or
        ``n``) beams become the completions; other prompts are generated as usual."""
        results: list[RequestOutput | None] = [None] * len(prompts)
        plain = [i for i, p in enumerate(params) if not p.use_beam_search]
        plain_items = [(prompts[i], params[i], priorities[i], loras[i]) for i in plain]
        for i, out in zip(plain, self._run(plain_items, use_tqdm)):
            results[i] = out
        tokenizer = self.get_tokenizer()
        for i, sp in enumerate(params):
            if not sp.use_beam_search:
                continue
            text, prompt_ids = self.llm_engine.tokenize_prompt(prompts[i])
            [beams] = self._beam_search(
                [prompt_ids], sp.beam_width, sp.max_tokens or self.llm_engine.max_model_len,
                sp.ignore_eos, sp.length_penalty, sp.early_stopping, loras[i],
            )
            completions = []
            for index, beam in enumerate(beams[: sp.n]):
                token_ids = beam.tokens[len(prompt_ids) :]
                decoded = ""
                if tokenizer is not None and sp.detokenize:
                    decoded = tokenizer.decode(token_ids, skip_special_tokens=sp.skip_special_tokens)
                completions.append(
                    CompletionOutput(
                        index=index,
                        text=decoded,
                        token_ids=token_ids,
                        cumulative_logprob=beam.cum_logprob,
                        logprobs=beam.logprobs if sp.logprobs is not None else None,
                        finish_reason=beam.finish_reason,
                    )
                )
            results[i] = RequestOutput(
                request_id=f"beam_search-{i}", prompt=text, prompt_token_ids=prompt_ids,
                outputs=completions, finished=True,
            )
        return results  # type: ignore[return-value]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations,
        formatted with the tokenizer's chat template (or ``chat_template``, a Jinja
        template). ``continue_final_message=True`` (with ``add_generation_prompt=False``)
        continues the last (assistant) message instead of starting a new one.

        A message's ``content`` is a string or, as in the OpenAI API, a list of
        ``{"type": "text", "text": ...}`` parts (joined by newlines, as the server
        does). ``tools`` (OpenAI function tools) go to the template's ``tools``
        variable; a template that does not use them renders as without them. An
        assistant message's ``tool_calls`` may give ``function.arguments`` as a JSON
        string (OpenAI's shape): the template gets the object, as vLLM renders it."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise InvalidRequestError("chat() needs a tokenizer; do not set skip_tokenizer_init")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError(  # vLLM's message
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                [_template_message(i, m) for i, m in enumerate(conversation)],
                chat_template=chat_template,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
            # The template already holds any special tokens it wants.
            ids = tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    # Pooling (runner="pooling"): vLLM's embed / encode / score.

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
        pooling_task: str = "embed",
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """The pooled hidden states of each prompt, in prompt order: ``.outputs.data``
        is a float32 tensor, ``[E]`` for ``pooling_task="embed"``, ``[n, E]`` (one row
        per prompt token) for ``"token_embed"``. Needs ``runner="pooling"``."""
        if lora_request is not None:
            raise InvalidRequestError("lora_request is not supported by the pooling runner; leave it None")
        prompts = _as_prompt_list(prompts)
        params = [
            dataclasses.replace(
                p, task=p.task or pooling_task,
                truncate_prompt_tokens=p.truncate_prompt_tokens if truncate_prompt_tokens is None
                else truncate_prompt_tokens,
            )
            for p in self._per_prompt(pooling_params or PoolingParams(), len(prompts), "pooling_params")
        ]
        return self.llm_engine.encode(prompts, params)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``.outputs.embedding``, a list of floats), in
        prompt order. Needs ``runner="pooling"``."""
        outputs = self.encode(
            prompts, pooling_params, use_tqdm, lora_request, "embed", truncate_prompt_tokens=truncate_prompt_tokens
        )
        return [EmbeddingRequestOutput.from_base(out) for out in outputs]

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        /,
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """The cosine similarity of the embeddings of text pairs, as vLLM scores
        with an embedding model: one ``data_1`` against each of ``data_2``, or
        ``data_1[i]`` against ``data_2[i]``. ``.outputs.score`` is a float."""
        first, second = _as_prompt_list(data_1), _as_prompt_list(data_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second) or not first:
            raise InvalidRequestError(
                f"score() pairs one data_1 with each data_2, or data_1[i] with data_2[i]; got {len(first)} "
                f"data_1 and {len(second)} data_2 prompts"
            )
        embeds = self.encode(
            first + second, pooling_params, use_tqdm, lora_request, "embed",
            truncate_prompt_tokens=truncate_prompt_tokens,
        )
        a, b = embeds[: len(first)], embeds[len(first) :]
        return [
            ScoringRequestOutput(
                x.request_id,
                ScoringOutput(torch.nn.functional.cosine_similarity(x.outputs.data, y.outputs.data, dim=0).item()),
                x.prompt_token_ids + y.prompt_token_ids,
            )
            for x, y in zip(a, b)
        ]

    def _run(
        self, items: list[tuple[PromptType, SamplingParams, int, LoRARequest | None]], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        order: dict[str, int] = {}
        arrival = time.perf_counter()
        try:
            for i, (prompt, params, prio, lora) in enumerate(items):
                order[engine.add_request(None, prompt, params, priority=prio, lora_request=lora)] = i
        except Exception:
            engine.abort_request(list(order))
            raise
        results: list[RequestOutput | None] = [None] * len(items)
        bar = _progress_bar(len(items)) if use_tqdm else None
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        self._record_finished(out, arrival)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request(list(order))
            raise
        finally:
            if bar is not None:
                bar.close()
        return results  # type: ignore[return-value]

    @staticmethod
    def _per_prompt(value, n: int, name: str, default: Any = None) -> list[Any]:
        if value is None:
            return [SamplingParams() if default is None else default for _ in range(n)]
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise InvalidRequestError(f"{name} has {len(value)} entries for {n} prompts")
            return list(value)
        return [value] * n

    # ------------------------------------------------------------------ #

    def start_profile(self) -> None:
        """Start a torch profiler trace, written to ``torch_profiler_dir`` or
        ``VFRAME_TORCH_PROFILER_DIR`` by ``stop_profile()``."""
        self.llm_engine.executor.collective_rpc("profile", (True,))

    def stop_profile(self) -> None:
        self.llm_engine.executor.collective_rpc("profile", (False,))

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    # LoRA adapters (enable_lora=True); requests name one with lora_request=.

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter ahead of the requests that name it."""
        self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.llm_engine.list_loras()

    def get_stats(self) -> dict[str, float]:
        return self.llm_engine.get_stats()

    def get_metrics(self) -> list[Metric]:
        """vLLM's ``LLM.get_metrics()``: ``vframe.v1.metrics.reader`` ``Counter``,
        ``Gauge`` and ``Histogram`` objects under the server's ``/metrics`` names
        (``vframe:generation_tokens``, ``vframe:num_requests_running`` ...). Counters
        count the requests this ``LLM`` ran to completion (``generate``, ``chat``);
        gauges are the engine's state now."""
        from vframe.v1.metrics.reader import get_metrics_snapshot

        return get_metrics_snapshot(self._server_metrics().registry, exclude=_NOT_MEASURED_OFFLINE)

    def _server_metrics(self) -> ServerMetrics:
        if self._metrics is None:
            from vframe.entrypoints.openai.metrics import ServerMetrics

            self._metrics = ServerMetrics(self.llm_engine.get_stats)
        return self._metrics

    def _record_finished(self, output: RequestOutput, arrival: float) -> None:
        """Count a finished request as the server counts one (``arrival``: when ``generate`` added it)."""
        metrics = self._server_metrics()
        metrics.prompt_tokens.inc(len(output.prompt_token_ids))
        metrics.generation_tokens.inc(sum(len(c.token_ids) for c in output.outputs))
        for completion in output.outputs:
            reason = completion.finish_reason or "abort"
            metrics.requests_finished.labels(getattr(reason, "value", reason)).inc()  # FinishReason or str
        metrics.e2e.observe(time.perf_counter() - arrival)


def _template_message(index: int, message: Message) -> Message:
    """``message`` as chat templates read it: a list of text parts as ``content``
    becomes one string, and an assistant's tool-call ``arguments`` (a JSON string in
    OpenAI's messages) an object, as the server renders them."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"chat(): message content part {part!r} is not supported; vframe serves text-only models, "
                    "so each part must be {'type': 'text', 'text': str}"
                )
            texts.append(part["text"])
        message = {**message, "content": "\n".join(texts)}
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        message = {**message, "tool_calls": [_template_call(index, j, call) for j, call in enumerate(calls)]}
    return message


def _template_call(index: int, j: int, call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    field = f"messages[{index}].tool_calls[{j}].function.arguments"
    arguments = tool_call_arguments(function.get("arguments"), field)
    return {**call, "function": {**function, "arguments": arguments}}


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a string, a token-id list, a prompt dict) as a list of one; a
    prompt dict with vLLM's ``prompt_embeds`` is refused by name."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    prompts = list(prompts)
    if any(isinstance(p, dict) and "prompt_embeds" in p for p in prompts):
        raise InvalidRequestError(
            "prompt_embeds is not supported yet: vframe's engine takes prompts as text or token ids "
            "(vframe.inputs.TextPrompt / TokensPrompt); pass the prompt's text or prompt_token_ids instead"
        )
    return prompts


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)


def _per_prompt_lora(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    if lora_request is None or not isinstance(lora_request, (list, tuple)):
        return [lora_request] * n
    if len(lora_request) != n:
        raise InvalidRequestError(f"lora_request has {len(lora_request)} entries for {n} prompts")
    return list(lora_request)
