"""Structured output: the interface a grammar library plugs in through.

A ``StructuredOutputBackend`` (registry kind ``structured_output``,
hook ``vframe_register_structured_output_backends``) is built once per engine
with the tokenizer. The engine compiles each constrained request's
``StructuredOutputsParams`` into a ``CompiledGrammar`` when the request is added
(a bad schema or regex fails there, with the library's message). The model
runner gives every such request its own ``GrammarMatcher``; each step it asks
the backend for one token bitmask row per constrained request, all rows in one
call (``fill_bitmask``), the sampler applies the whole ``[B, ceil(V/32)]`` mask
in one batched operation, and the sampled token is fed back with
``accept_token``. When the grammar is complete only end-of-sequence tokens are
allowed, so the request stops there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from vframe.core.sampling_params import StructuredOutputsParams

DEFAULT_BACKEND = "guidance"


class GrammarMatcher(ABC):
    """One completion's position in its grammar.

    Made by ``CompiledGrammar.new_matcher`` when the request enters the model
    runner, and again after a preemption (the new one is fed the tokens already
    generated). Used from the engine's thread only.
    """

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it.

        Called once per sampled token, in order. ``False`` or an exception
        fails this request alone (``finish_reason="error"``)."""


class CompiledGrammar(ABC):
    """A request's compiled constraint; immutable, shared by the request's completions.

    ``backend`` must be set (to the backend that compiled it): the runner
    groups matchers by it for ``fill_bitmask``.
    """

    backend: StructuredOutputBackend

    @abstractmethod
    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the start of the grammar, for one completion."""


class StructuredOutputBackend(ABC):
    """A grammar library, built once per engine on first use.

    Constructed as ``Backend(tokenizer, vocab_size, eos_token_ids)`` with the
    engine's (fast, Hugging Face) tokenizer and the model's vocabulary size; or,
    when its ``__init__`` declares a parameter named ``context`` (plugin API 1.2),
    as ``Backend(context=<PluginContext>)``, and then it calls
    ``super().__init__(context.tokenizer, context.vocab_size, set(context.eos_token_ids))``."""

    name: ClassVar[str]

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    @classmethod
    def check_available(cls) -> list[str]:
        """Reasons it cannot run here (a missing package); empty if it can."""
        return []

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Raise ``InvalidRequestError`` with the library's reason if the constraint is invalid.

        Called once per request when it is added; a server calls it from a
        worker thread, possibly while a step runs ``fill_bitmask`` on the
        engine's thread, so it must not change state those calls share."""

    @abstractmethod
    def fill_bitmask(self, matchers: list[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """Write the allowed-token bits of each ``(matcher, row)`` into row ``row`` of
        ``bitmask [B, ceil(V / 32)]`` (int32, contiguous, on the CPU); bit ``j`` of
        word ``w`` stands for token ``32 * w + j``."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
