"""Presence, frequency and repetition penalties, with the token counts they need.

``PenaltyCounts`` keeps one row per request that has a penalty, for as long as
the request lives (through preemptions too): how often each vocabulary entry
was generated ``[R, V] int32`` and which entries occur in the prompt
``[R, V] bool``. A row is filled once when the request arrives and updated with
one batched ``index_put_`` per step; nothing loops over the vocabulary.
"""

from __future__ import annotations

import torch


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties on ``logits [P, V]``, each row with its own values ``[P]``.

    Repetition (as transformers' ``RepetitionPenaltyLogitsProcessor``): a token seen
    in the prompt or the output has its logit divided by the penalty if positive,
    multiplied if not. Then ``logit -= frequency * count + presence * (count > 0)``
    over the generated tokens only (OpenAI's definition)."""
    generated = output_counts > 0  # [P, V]
    penalty = torch.where(prompt_mask | generated, repetition.unsqueeze(1), 1.0)  # [P, V]
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    return logits - frequency.unsqueeze(1) * output_counts - presence.unsqueeze(1) * generated


class PenaltyCounts:
    """Persistent per-request token statistics, one row per request with penalties."""

    def __init__(self, vocab_size: int, device: torch.device, initial_rows: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts = torch.zeros(initial_rows, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(initial_rows, vocab_size, dtype=torch.bool, device=device)
        self._free_rows = list(range(initial_rows - 1, -1, -1))  # pop() -> 0, 1, ...

    def add(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> int:
        """Give a request a row holding its prompt and (after a preemption) output tokens."""
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self.output_counts[row].zero_()
        self.prompt_mask[row].zero_()
        self.prompt_mask[row, torch.tensor(prompt_token_ids, dtype=torch.long, device=self.device)] = True
        if output_token_ids:
            ids = torch.tensor(output_token_ids, dtype=torch.long, device=self.device)
            self.output_counts[row].index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        return row

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def record(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count one sampled token per row: ``rows [N]``, ``token_ids [N]``."""
        ones = torch.ones_like(token_ids, dtype=torch.int32)
        self.output_counts.index_put_((rows, token_ids), ones, accumulate=True)

    def _grow(self) -> None:
        old = self.output_counts.shape[0]
        pad = dict(dtype=torch.int32, device=self.device)
        self.output_counts = torch.cat([self.output_counts, torch.zeros(old, self.vocab_size, **pad)])
        self.prompt_mask = torch.cat(
            [self.prompt_mask, torch.zeros(old, self.vocab_size, dtype=torch.bool, device=self.device)]
        )
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))
