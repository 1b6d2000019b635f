"""The default sampler: one batched pass over requests with different parameters.

Order of operations on the logits ``[B, V]``::

    raw logits ──► logprobs (if asked; vLLM reports the model's raw distribution)
         │
         ├─ ban tokens (min_tokens) ─► argmax                       (greedy rows)
         └─ / temperature ─► min_p ─► top_k ─► top_p ─► sample       (random rows)

Random rows sample with the exponential race ``argmax(p / q)``, ``q ~ Exp(1)``,
which draws from ``p`` without a cumulative sum; seeded rows draw ``q`` from
their own generator so their tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

from vframe.core.interfaces import Sampler
from vframe.core.outputs import SamplerOutput
from vframe.core.sample.metadata import SamplingMetadata


class DefaultSampler(Sampler):
    def __call__(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
        md = sampling_metadata
        logits = logits.float()  # [B, V]
        out = SamplerOutput(sampled_token_ids=torch.empty(0, dtype=torch.long))
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if md.banned_token_ids:
            logits = logits.clone()
            for row, token_ids in md.banned_token_ids:
                logits[row, token_ids] = float("-inf")

        greedy = logits.argmax(dim=-1)
        if md.all_greedy:
            sampled = greedy
        else:
            sampled = torch.where(md.greedy_mask, greedy, self._sample(logits, md))
        out.sampled_token_ids = sampled
        if raw_logprobs is not None:
            self._gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs, out)
        return out

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        logits = logits / md.temperature.unsqueeze(1)
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = torch.softmax(logits, dim=-1)  # [B, V]
        q = torch.empty_like(probs).exponential_()
        for row, generator in md.generators.items():
            q[row].exponential_(generator=generator)
        return probs.div_(q).argmax(dim=-1)

    @staticmethod
    def _gather_logprobs(
        logprobs: torch.Tensor, sampled: torch.Tensor, k: int, out: SamplerOutput
    ) -> None:
        chosen = logprobs.gather(1, sampled.unsqueeze(1))  # [B, 1]
        out.sampled_ranks = (logprobs > chosen).sum(dim=1) + 1  # [B]
        if k > 0:
            top_lp, top_ids = logprobs.topk(k, dim=-1)  # [B, K]
            out.logprob_token_ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1)
            out.logprobs = torch.cat([chosen, top_lp], dim=1)
        else:
            out.logprob_token_ids = sampled.unsqueeze(1)
            out.logprobs = chosen


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the top token's."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (0 = all), then the smallest set
    whose probability reaches ``top_p``. Ties at the boundary are kept."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)  # ascending [B, V]
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))  # [B, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # ascending cumulative mass
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
