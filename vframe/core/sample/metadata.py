"""Per-step sampling parameters of the whole batch, as tensors.

Every optional field is ``None`` (or empty) when no row of the step uses it, so
that a batch of plain greedy or plain random requests pays for none of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vframe.core.sample.batch_processors import LogitsProcessor


@dataclass
class PenaltyInputs:
    """The rows of the batch that have a penalty, and what the penalties need.

    ``P`` is the number of such rows; every tensor is on the logits' device.

    Attributes:
        rows: ``[P]`` int64, the rows of the batch (``SamplingMetadata`` rows)
            these entries belong to, ascending.
        presence: ``[P]`` float32, ``presence_penalty``; 0.0 = off.
        frequency: ``[P]`` float32, ``frequency_penalty``; 0.0 = off.
        repetition: ``[P]`` float32, ``repetition_penalty``; 1.0 = off.
        output_counts: ``[P, V]`` int32, how often each token was generated so
            far (the prompt not counted).
        prompt_mask: ``[P, V]`` bool, ``True`` where the token occurs in the prompt.
    """

    rows: torch.Tensor  # [P] int64, rows of the batch
    presence: torch.Tensor  # [P] float32, 0 = off
    frequency: torch.Tensor  # [P] float32, 0 = off
    repetition: torch.Tensor  # [P] float32, 1 = off
    output_counts: torch.Tensor  # [P, V] int32: how often each token was generated
    prompt_mask: torch.Tensor  # [P, V] bool: the token occurs in the prompt


@dataclass
class SamplingMetadata:
    """The sampling parameters of one step's batch, as the sampler receives them.

    Row ``i`` of every tensor belongs to the ``i``-th sampled request of the
    step, which is row ``i`` of the ``[B, V]`` float32 logits. Here ``B`` counts
    only the requests that sample this step: a request in the middle of a
    chunked prefill is not in the batch. ``V`` is the logits' width (the
    model's output-head size, which can exceed the tokenizer's vocabulary).
    Tensors live on the logits' device. Optional fields are ``None`` (or empty)
    when no row uses them.

    Attributes:
        temperature: ``[B]`` float32; greedy rows hold 1.0 (so that dividing by
            it is harmless).
        greedy_mask: ``[B]`` bool, ``True`` for rows that take the argmax
            (temperature below 1e-5).
        all_greedy: every row is greedy: nothing random needs computing.
        top_k: ``[B]`` int64, 0 = off; ``None`` when no row sets it.
        top_p: ``[B]`` float32, 1.0 = off; ``None`` when no row sets it.
        min_p: ``[B]`` float32, 0.0 = off; ``None`` when no row sets it.
        generators: ``row -> torch.Generator`` (on the logits' device) for rows
            with a ``seed``: their random draws come from it alone, so their
            tokens do not depend on the rest of the batch. Each sampled token
            takes one float64 uniform draw (``sampler.sample_from_probs``); a
            re-admitted request's generator has been advanced past the draws
            it made before its preemption.
        max_num_logprobs: the largest ``logprobs`` asked by any row (0 = only
            the sampled token's); ``None`` when no row asks for logprobs.
        banned_token_ids: ``(row, token ids)`` whose logits are forced to
            ``-inf``: stop tokens before ``min_tokens``, and the last token of
            each bad word whose other tokens end the output. Only rows with a
            ban, ascending.
        logit_bias: ``(rows [N] int64, token ids [N] int64, bias [N] float32)``,
            one entry per biased token (a row appears once per token), added to
            the logits; ``None`` when no row has a ``logit_bias``.
        allowed_token_mask: ``(rows [A] int64, mask [A, V] bool)``: in each of
            these rows only the ``True`` tokens may be sampled
            (``allowed_token_ids``); ``None`` when no row restricts.
        token_bitmask: ``[B, ceil(V / 32)]`` int32, structured output: bit ``j``
            of word ``w`` set = token ``32 * w + j`` allowed; rows without a
            grammar are all ones (-1). ``None`` when no row has a grammar.
        penalties: the rows with a presence, frequency or repetition penalty;
            ``None`` when no row has one.
        logits_processors: ``(row, fn)`` per row with logits processors:
            ``fn(logits [V] float32) -> logits [V]`` runs that request's
            processors in order (it may modify the row in place).
        batch_logits_processors: the engine-wide ``LogitsProcessor`` objects
            that may change the argmax; ``apply(logits [B, V])`` runs before
            every other rewrite (``vframe/core/sample/batch_processors.py``).
        argmax_invariant_logits_processors: the engine-wide ones that do not;
            they run on the random rows' logits after temperature.
    """

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
    # Engine-wide vLLM v1 LogitsProcessor objects: apply(logits [B, V]) -> [B, V].
    batch_logits_processors: list[LogitsProcessor] = field(default_factory=list)
    argmax_invariant_logits_processors: list[LogitsProcessor] = field(default_factory=list)

    @property
    def needs_processing(self) -> bool:
        """Whether anything rewrites the logits before temperature and sampling."""
        return bool(
            self.banned_token_ids
            or self.batch_logits_processors
            or self.logits_processors
            or self.logit_bias is not None
            or self.allowed_token_mask is not None
            or self.token_bitmask is not None
            or self.penalties is not None
        )
