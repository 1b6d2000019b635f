"""Per-step sampling parameters of the whole batch, as tensors.

Every optional field is ``None`` (or empty) when no row of the step uses it, so
that a batch of plain greedy or plain random requests pays for none of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class PenaltyInputs:
    """The rows of the batch that have a penalty, and what the penalties need."""

    rows: torch.Tensor  # [P] int64, rows of the batch
    presence: torch.Tensor  # [P] float32, 0 = off
    frequency: torch.Tensor  # [P] float32, 0 = off
    repetition: torch.Tensor  # [P] float32, 1 = off
    output_counts: torch.Tensor  # [P, V] int32: how often each token was generated
    prompt_mask: torch.Tensor  # [P, V] bool: the token occurs in the prompt


@dataclass
class SamplingMetadata:
    """Row ``i`` of every tensor belongs to the ``i``-th sampled request of the step."""

    temperature: torch.Tensor  # [B] float32; greedy rows hold 1.0
    greedy_mask: torch.Tensor  # [B] bool
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [B] int64, 0 = off; None if no row uses it
    top_p: torch.Tensor | None = None  # [B] float32, 1.0 = off
    min_p: torch.Tensor | None = None  # [B] float32, 0.0 = off
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # seeded rows
    max_num_logprobs: int | None = None  # largest `logprobs` asked in the batch
    # (row, token ids) whose logits are forced to -inf: EOS before min_tokens, bad words.
    banned_token_ids: list[tuple[int, list[int]]] = field(default_factory=list)
    # (rows [N], token ids [N], bias [N]) added to the logits: logit_bias.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (rows [A], mask [A, V] bool): only the True tokens may be sampled: allowed_token_ids.
    allowed_token_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    # [B, ceil(V / 32)] int32, bit j of word w set = token 32w + j allowed (structured
    # output); unconstrained rows are all ones (-1).
    token_bitmask: torch.Tensor | None = None
    penalties: PenaltyInputs | None = None
    # (row, fn): fn(logits [V]) -> logits [V] runs the request's own logits processors.
    logits_processors: list[tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = field(default_factory=list)

    @property
    def needs_processing(self) -> bool:
        """Whether anything rewrites the logits before temperature and sampling."""
        return bool(
            self.banned_token_ids
            or self.logits_processors
            or self.logit_bias is not None
            or self.allowed_token_mask is not None
            or self.token_bitmask is not None
            or self.penalties is not None
        )
