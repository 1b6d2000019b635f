"""Per-request logits processors: user callables and registered plugins.

A request names them in ``SamplingParams.logits_processors``; each entry is

* a callable ``fn(output_token_ids, logits[V]) -> logits[V]`` or
  ``fn(prompt_token_ids, output_token_ids, logits[V]) -> logits[V]`` (vLLM's two
  forms), used as is: state it keeps is shared by every request given it;
* the name of a ``logits_processor`` registry entry (a ``LogitsProcessor``
  subclass), or ``(name, kwargs)``: a fresh instance ``cls(**kwargs)`` per
  completion, so that processors may keep per-request state. A class whose
  ``__init__`` declares ``context`` is built as ``cls(context=..., **kwargs)``
  with the engine's ``PluginContext`` (plugin API 1.2), so a request may not
  pass a kwarg of that name.

The engine resolves names when the request is added (an unknown name fails
then, listing the known ones); the model runner builds one
``RequestLogitsProcessors`` per request and the sampler calls it on that
request's row of the logits, after the model and before any other rewrite.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from vframe.core.plugin_context import PluginContext, takes_context
from vframe.core.sampling_params import LogitsProcessorSpec
from vframe.errors import InvalidRequestError

# Builds one request's processor: a zero-argument callable.
ProcessorFactory = Callable[[], Callable[..., torch.Tensor]]


def resolve_logits_processors(
    specs: list[LogitsProcessorSpec], context: PluginContext
) -> list[ProcessorFactory]:
    """Turn ``SamplingParams.logits_processors`` into factories; names are looked
    up in the ``logits_processor`` registry (raises ``PluginError`` if unknown)."""
    from vframe.plugins import get_registry

    factories: list[ProcessorFactory] = []
    for spec in specs:
        if isinstance(spec, (str, tuple)):
            name, kwargs = (spec, {}) if isinstance(spec, str) else spec
            cls = get_registry("logits_processor").load(name)
            if "context" in kwargs:
                raise InvalidRequestError(
                    f"logits processor {name!r}: the argument 'context' is reserved (the engine "
                    "passes its PluginContext to processors that declare it); rename it"
                )
            if takes_context(cls):
                kwargs = {**kwargs, "context": context}
            try:
                inspect.signature(cls).bind(**kwargs)
            except TypeError as e:
                shown = {k: v for k, v in kwargs.items() if k != "context"}
                raise InvalidRequestError(f"logits processor {name!r}: bad arguments {shown}: {e}") from None
            factories.append(lambda cls=cls, kwargs=kwargs: cls(**kwargs))
        else:
            factories.append(lambda fn=spec: fn)
    return factories


def _num_args(fn: Callable[..., Any]) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return 2
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in params if p.kind in positional)


class RequestLogitsProcessors:
    """One request's processors, called on its row of the logits each step."""

    def __init__(
        self, factories: list[ProcessorFactory], token_ids: list[int], num_prompt_tokens: int
    ) -> None:
        self.processors = [(fn, _num_args(fn) >= 3) for fn in (f() for f in factories)]
        self.token_ids = token_ids  # the runner's list: prompt + generated, grows each step
        self.num_prompt_tokens = num_prompt_tokens

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        prompt = self.token_ids[: self.num_prompt_tokens]
        output = self.token_ids[self.num_prompt_tokens :]
        for fn, with_prompt in self.processors:
            logits = fn(prompt, output, logits) if with_prompt else fn(output, logits)
        return logits
