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
    """One request's position in its grammar."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""


class CompiledGrammar(ABC):
    """A request's compiled constraint; immutable, shared by the request's completions."""

    backend: StructuredOutputBackend

    @abstractmethod
    def new_matcher(self) -> GrammarMatcher: ...


class StructuredOutputBackend(ABC):
    """A grammar library. Constructed as ``Backend(tokenizer, vocab_size, eos_token_ids)``
    with the engine's (fast, Hugging Face) tokenizer and the model's vocabulary size."""

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
        """Raise ``InvalidRequestError`` with the library's reason if the constraint is invalid."""

    @abstractmethod
    def fill_bitmask(self, matchers: list[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """Write the allowed-token bits of each ``(matcher, row)`` into row ``row`` of
        ``bitmask [B, ceil(V / 32)]`` (int32, contiguous, on the CPU); bit ``j`` of
        word ``w`` stands for token ``32 * w + j``."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
