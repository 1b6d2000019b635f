"""What the engine completes in a request's ``SamplingParams`` before it is queued:
everything that needs the tokenizer, the vocabulary or a plugin.

* end-of-sequence ids (unless ``ignore_eos``) and ``bad_words`` token sequences;
* token ids in ``allowed_token_ids`` / ``logit_bias`` / ``stop_token_ids`` checked against
  the vocabulary, ``logprobs`` / ``prompt_logprobs`` against ``max_logprobs``;
* ``logits_processors`` names resolved in the ``logits_processor`` registry;
* ``structured_outputs`` compiled by its ``structured_output`` (one
  backend instance per name, built on first use).

Plugin objects built here (logits processors, structured-output backends) get
the engine's ``PluginContext`` when their ``__init__`` declares ``context``.
"""

from __future__ import annotations

import threading

from vframe.core.plugin_context import PluginContext, takes_context
from vframe.core.sample.logits_processors import resolve_logits_processors
from vframe.core.sample.structured import DEFAULT_BACKEND, StructuredOutputBackend
from vframe.core.sampling_params import SamplingParams
from vframe.errors import InvalidRequestError


class SamplingSetup:
    def __init__(self, context: PluginContext) -> None:
        self.context = context
        self.tokenizer = context.tokenizer
        self.vocab_size = context.vocab_size
        max_logprobs = context.engine_config.model.max_logprobs
        self.max_logprobs = self.vocab_size if max_logprobs == -1 else min(max_logprobs, self.vocab_size)
        self.eos_token_ids = set(context.eos_token_ids)
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._backends_lock = threading.Lock()

    def prepare(self, params: SamplingParams) -> None:
        """Fill the engine-side fields of ``params``; raises ``InvalidRequestError``."""
        params.update_from_tokenizer(self.eos_token_ids, self.tokenizer)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise InvalidRequestError(
                    f"SamplingParams.{name}={value} is too large: this engine returns at most "
                    f"{self.max_logprobs} (max_logprobs)"
                )
        for name, ids in (
            ("allowed_token_ids", params.allowed_token_ids or []),
            ("logit_bias", list(params.logit_bias or {})),
            ("stop_token_ids", params.stop_token_ids),
        ):
            out_of_range = [t for t in ids if t >= self.vocab_size]
            if out_of_range:
                raise InvalidRequestError(
                    f"SamplingParams.{name} has token ids out of range [0, {self.vocab_size}): {out_of_range[:5]}"
                )
        if params.logits_processors:
            params._logits_processor_factories = resolve_logits_processors(params.logits_processors, self.context)
        self.compile_structured_output(params)

    def restore(self, params: SamplingParams) -> None:
        """Rebuild the plugin objects ``prepare`` attached, in a worker process that
        received ``params`` without them (``vframe/executor/transport.py``)."""
        if params.logits_processors and not params._logits_processor_factories:
            params._logits_processor_factories = resolve_logits_processors(params.logits_processors, self.context)
        self.compile_structured_output(params)

    def compile_structured_output(self, params: SamplingParams) -> None:
        """Compile ``params.structured_outputs`` into ``params._grammar`` unless done
        already. Thread-safe: a server calls it in a worker thread before the request
        reaches the engine thread, so that a slow grammar never stalls a step."""
        if params.structured_outputs is None or params._grammar is not None:
            return
        backend = self.backend(params.structured_outputs.backend or DEFAULT_BACKEND)
        params._grammar = backend.compile(params.structured_outputs)

    def backend(self, name: str) -> StructuredOutputBackend:
        with self._backends_lock:
            backend = self._backends.get(name)
            if backend is None:
                from vframe.plugins import get_registry

                if self.tokenizer is None:
                    raise InvalidRequestError("structured_outputs needs a tokenizer (skip_tokenizer_init is set)")
                cls = get_registry("structured_output").load(name)
                if takes_context(cls):
                    backend = cls(context=self.context)
                else:
                    backend = cls(self.tokenizer, self.vocab_size, self.eos_token_ids)
                self._backends[name] = backend
            return backend
