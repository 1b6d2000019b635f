"""What the engine hands to plugin code: a ``PluginContext`` when it constructs a
plugin's object, an ``EngineView`` to every lifecycle hook.

Both belong to one engine, so two engines serving different models in one
process give each plugin object the tokenizer and vocabulary of its own model.
Fields are part of the plugin API (docs/plugins.md, "API versioning"): new
ones arrive in minor versions, none is removed or changes meaning within a major.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from vframe.core.config import EngineConfig


@dataclass(frozen=True, eq=False)
class PluginContext:
    """The engine a plugin object is built for (plugin API 1.2).

    Passed as the keyword argument ``context`` to the constructor of a logits
    processor, a sampler or a structured-output backend whose ``__init__``
    declares a parameter named ``context``. One per engine, compared and hashed
    by identity: work done once per engine (say, decoding every token's text)
    can be cached in a ``weakref.WeakKeyDictionary`` keyed by the context.

    Attributes:
        engine_config: the engine's validated configuration (``EngineConfig``).
        model_config: the served model's Hugging Face configuration
            (``transformers.PretrainedConfig``: ``hidden_size``, ``num_hidden_layers``, ...).
        tokenizer: the model's Hugging Face tokenizer; ``None`` when the engine
            runs with ``skip_tokenizer_init=True``.
        vocab_size: columns of the logits a sampler or logits processor sees;
            can exceed ``len(tokenizer)`` (padding rows of the output head).
        eos_token_ids: every token id that ends a sequence for this model.
        device: where the model runs and the logits live (``torch.device``).
        dtype: the model's compute dtype (``torch.float32`` / ``torch.bfloat16``);
            logits reach the sampler as ``float32`` whatever it is.
    """

    engine_config: EngineConfig = field(repr=False)
    model_config: Any = field(repr=False)
    tokenizer: Any | None = field(repr=False)
    vocab_size: int
    eos_token_ids: frozenset[int]
    device: torch.device
    dtype: torch.dtype


@dataclass(frozen=True, eq=False)
class EngineView:
    """A read-only view of one engine, passed to every lifecycle hook as
    ``engine_view`` (plugin API 1.2). Unlike the ``engine`` argument (the
    ``LLMEngine`` itself, whose attributes may change in any release) these
    fields are a stable API.

    Attributes:
        engine_id: unique within the process (``"engine-0"``, ``"engine-1"``, ...);
            tells apart the engines of one process in hooks such as
            ``vframe_request_finished``.
        model: the model as configured (a path, or ``"SmolLM2-135M-Instruct"``
            for the embedded default).
        context: the engine's ``PluginContext`` (tokenizer, vocabulary, configs).
        max_model_len: most tokens (prompt plus output) one request may hold.
        block_size: tokens per KV cache block.
        num_kv_blocks: KV cache blocks on the device.
    """

    engine_id: str
    model: str
    context: PluginContext = field(repr=False)
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    _stats: Callable[[], dict[str, float]] | None = field(default=None, repr=False)

    def stats(self) -> dict[str, float]:
        """The engine's current counters: ``num_running``, ``num_waiting``,
        ``kv_cache_usage`` (0.0 to 1.0), ``num_preemptions`` and whatever the
        configured scheduler and KV cache manager add."""
        return dict(self._stats()) if self._stats is not None else {}


_engine_counter = itertools.count()


def next_engine_id() -> str:
    """``"engine-0"``, ``"engine-1"``, ...: a fresh id for every engine of the process."""
    return f"engine-{next(_engine_counter)}"


def takes_context(cls: type) -> bool:
    """Whether ``cls.__init__`` declares a parameter named ``context`` (by name or
    keyword-only; ``**kwargs`` does not count): such a plugin class is built with
    ``context=<PluginContext>``, any other exactly as before plugin API 1.2."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # no introspectable signature
        return False
    param = params.get("context")
    return param is not None and param.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )
