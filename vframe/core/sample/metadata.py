"""Per-step sampling parameters of the whole batch, as tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    # (row, token ids) whose logits are forced to -inf, e.g. EOS before min_tokens.
    banned_token_ids: list[tuple[int, list[int]]] = field(default_factory=list)
