"""Conformance checks for logits processors: ``check_logits_processor``.

A registered logits processor is built once per completion and called once
per step on that request's row of the logits, with the tokens generated so
far (see ``vframe.core.sample.logits_processors``). The check builds it as the
engine does (``cls(context=..., **kwargs)`` when its ``__init__`` declares
``context``) and calls it the way the sampler does, on a row of a ``[B, V]``
float32 tensor, over a short generation whose first step has an empty history.

What "correct" means: each call returns a float32 ``[V]`` tensor on the
logits' device (the same tensor, changed in place, is fine) and leaves the
input's shape alone; it introduces no NaN and no ``+inf`` (either makes the
softmax NaN) and does not mask every token (``-inf`` everywhere leaves the
sampler nothing to pick); two fresh instances given equal inputs return equal
outputs, bit for bit, so that a seeded request is reproducible. Which tokens
it favours is the author's business: the check knows nothing of that.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vframe.core.plugin_context import PluginContext

DEFAULT_VOCAB_SIZE = 256  # without a context; pass vocab_size= for processors that touch given ids
NUM_STEPS = 6
PROMPT_LEN = 5


def check_logits_processor(
    processor: str | type,
    *,
    context: PluginContext | None = None,
    kwargs: dict[str, Any] | None = None,
    vocab_size: int | None = None,
) -> None:
    """Build ``processor`` (a ``logits_processor`` registry name or the class)
    with ``kwargs`` and check it over a generation of ``NUM_STEPS`` steps;
    raise ``AssertionError`` naming the step and what is wrong.

    ``context``: the ``PluginContext`` given to a processor that declares one;
    when it is needed and not given, the embedded model's
    (``make_plugin_context()``: loads that model, several seconds).
    ``vocab_size``: columns of the logits; default ``context.vocab_size``,
    else ``DEFAULT_VOCAB_SIZE``.
    """
    kwargs = dict(kwargs or {})
    cls = _load(processor)
    from vframe.core.plugin_context import takes_context

    if context is None and takes_context(cls):
        context = make_plugin_context()
    factory = _factory(processor, cls, kwargs, context)
    size = vocab_size or (context.vocab_size if context is not None else DEFAULT_VOCAB_SIZE)
    device = context.device if context is not None else torch.device("cpu")
    label = f"logits processor {processor!r}" if isinstance(processor, str) else f"logits processor {cls.__qualname__}"

    first = _generate(factory, size, device, label)
    second = _generate(factory, size, device, label)
    for step, (a, b) in enumerate(zip(first, second, strict=True)):
        if not torch.equal(a, b):
            diff = (a - b).abs().nan_to_num(posinf=float("inf")).max().item()
            raise AssertionError(
                f"{label}: not deterministic: at step {step} two fresh instances given equal token ids "
                f"and logits returned different logits (max difference {diff:.3g})"
            )


def make_plugin_context(model: str | os.PathLike[str] | None = None, **engine_kwargs: Any) -> PluginContext:
    """The ``PluginContext`` a real engine builds for ``model`` (default: the
    embedded SmolLM2), from an ``LLM`` made with ``engine_kwargs``. Loads the
    model: a few seconds; build it once per test session."""
    from vframe import LLM

    llm = LLM(None if model is None else str(model), **engine_kwargs)
    return llm.llm_engine.plugin_context


def _load(processor: str | type) -> type:
    if isinstance(processor, str):
        from vframe.plugins import get_registry

        return get_registry("logits_processor").load(processor)
    return processor


def _factory(
    processor: str | type, cls: type, kwargs: dict[str, Any], context: PluginContext | None
) -> Callable[[], Callable[..., torch.Tensor]]:
    if isinstance(processor, str):
        # A registered name goes exactly the engine's way.
        from vframe.core.sample.logits_processors import resolve_logits_processors

        return resolve_logits_processors([(processor, kwargs)], context)[0]  # type: ignore[arg-type]
    from vframe.core.plugin_context import takes_context

    if takes_context(cls):
        kwargs = {**kwargs, "context": context}
    return lambda: cls(**kwargs)


def _generate(
    factory: Callable[[], Callable[..., torch.Tensor]], vocab_size: int, device: torch.device, label: str
) -> list[torch.Tensor]:
    """One request's steps with a fresh instance; the outputs, in order."""
    from vframe.core.sample.logits_processors import RequestLogitsProcessors

    gen = torch.Generator().manual_seed(0)
    token_ids = torch.randint(0, vocab_size, (PROMPT_LEN,), generator=gen).tolist()  # prompt
    try:
        processors = RequestLogitsProcessors([factory], token_ids, PROMPT_LEN)
    except Exception as e:
        raise AssertionError(f"{label}: construction raised {type(e).__name__}: {e}") from e
    outputs = []
    for step in range(NUM_STEPS):
        batch = torch.randn(2, vocab_size, generator=gen).to(device)  # [B, V] float32
        row = batch[1]
        history = token_ids[PROMPT_LEN:]
        where = f"{label}, step {step} (generated so far: {history})"
        try:
            out = processors(row)
        except Exception as e:
            raise AssertionError(f"{where}: raised {type(e).__name__}: {e}") from e
        _check_output(out, row, vocab_size, device, where)
        outputs.append(out.detach().clone())
        # the next token: the last one again on step 3, so that histories repeat tokens
        token_ids.append(token_ids[-1] if step == 3 else int(torch.randint(0, vocab_size, (1,), generator=gen)))
    return outputs


def _check_output(out: object, row: torch.Tensor, vocab_size: int, device: torch.device, where: str) -> None:
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"{where}: returned {type(out).__name__}, not a tensor")
    if tuple(out.shape) != (vocab_size,) or out.dtype != torch.float32 or out.device.type != device.type:
        raise AssertionError(
            f"{where}: returned {tuple(out.shape)} {out.dtype} on {out.device}, "
            f"expected ({vocab_size},) torch.float32 on {device}"
        )
    if tuple(row.shape) != (vocab_size,):
        raise AssertionError(f"{where}: changed its input's shape to {tuple(row.shape)}")
    nan = out.isnan().nonzero().flatten()
    if nan.numel():
        raise AssertionError(f"{where}: introduced NaN at token ids {nan[:5].tolist()}")
    pos_inf = (out == float("inf")).nonzero().flatten()
    if pos_inf.numel():
        raise AssertionError(f"{where}: set +inf at token ids {pos_inf[:5].tolist()} (softmax would be NaN)")
    if (out == float("-inf")).all():
        raise AssertionError(f"{where}: masked every token with -inf; the sampler would have nothing to pick")
