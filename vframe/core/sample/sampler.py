"""The default sampler: one batched pass over requests with different parameters.

Order of operations on the logits ``[B, V]``::

    raw logits ──► logprobs (if asked; vLLM reports the model's raw distribution)
         │
         ▼  (only the parts some row of the batch uses)
    engine-wide batch logits processors (LLM(logits_processors=...), not argmax-invariant)
    ─► request logits processors ─► logit_bias ─► allowed_token_ids ─► banned tokens
    (min_tokens, bad_words) ─► structured-output bitmask ─► penalties
         │
         ├─ argmax                                                   (greedy rows)
         └─ / temperature ─► argmax-invariant batch processors ─► min_p ─► top_k
              ─► top_p ─► sample                                     (random rows)

Random rows sample by inverting each row's cumulative distribution (float64) with
one uniform number (``sample_from_probs``); seeded rows draw it from their own
generator so their tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

from vframe.core.interfaces import Sampler
from vframe.core.outputs import RequestError, SamplerOutput
from vframe.core.sample.batch_processors import apply_processors
from vframe.core.sample.metadata import SamplingMetadata
from vframe.core.sample.penalties import apply_penalties
from vframe.layers import cpu_ops


class DefaultSampler(Sampler):
    def __call__(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
        md = sampling_metadata
        logits = logits.float()  # [B, V]
        out = SamplerOutput(sampled_token_ids=torch.empty(0, dtype=torch.long))
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if md.needs_processing:
            logits = process_logits(logits.clone(), md, out.failed_rows)
            # A row of only -inf would "sample" token 0: report it instead.
            no_token = ~(logits.amax(dim=-1) > float("-inf"))  # [B]; NaN counts too
            if no_token.any():
                out.no_valid_token_rows = no_token.nonzero().flatten().tolist()
                logits[no_token] = 0.0  # keeps the rest of the batch's arithmetic finite

        # the argmax only where a row is greedy (a batch of random rows skips it)
        greedy = cpu_ops.argmax(logits) if md.all_greedy or bool(md.greedy_mask.any()) else None
        if md.all_greedy:
            sampled = greedy
        else:
            sampled = self._sample(logits, md)
            if greedy is not None:
                sampled = torch.where(md.greedy_mask, greedy, sampled)
        out.sampled_token_ids = sampled
        if raw_logprobs is not None:
            self._gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs, out)
        return out

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        logits = logits / md.temperature.unsqueeze(1)
        if md.argmax_invariant_logits_processors:
            logits = apply_processors(md.argmax_invariant_logits_processors, logits)
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        return sample_from_probs(torch.softmax(logits, dim=-1), md.generators)

    @staticmethod
    def _gather_logprobs(
        logprobs: torch.Tensor, sampled: torch.Tensor, k: int, out: SamplerOutput
    ) -> None:
        top_ids, top_lp, ranks = gather_logprobs(logprobs, sampled, k)
        out.logprob_token_ids, out.logprobs, out.sampled_ranks = top_ids, top_lp, ranks


def sample_from_probs(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs [B, V]``, drawn by inverting its cumulative
    distribution with one uniform number: the first token whose running sum (float64)
    passes ``u`` times the row's total. A zero-probability token is never drawn. Rows
    in ``generators`` (seeded requests) take their number from their own generator,
    one ``torch.rand(1, dtype=float64)`` per token; the others from the global one.

    The exponential race (``argmax(probs / Exp(1))``, vLLM's) draws V random numbers
    per row, which on the CPU cost more than the rest of the sampler: SmolLM2's 49,152
    tokens, 2 threads, 64 rows 67 ms against 3.7 ms here, one row 1.06 against 0.09 ms."""
    rows = probs.shape[0]
    u = torch.rand(rows, 1, dtype=torch.float64, device=probs.device)
    for row, generator in generators.items():
        u[row] = torch.rand(1, dtype=torch.float64, generator=generator, device=probs.device)
    cdf = probs.double().cumsum(dim=-1)  # [B, V]
    # u < 1, so the target stays below the total and some token passes it
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ``logprobs [N, V]`` and the chosen ``token_ids [N]``: ids ``[N, 1 + k]`` and
    logprobs ``[N, 1 + k]`` (the chosen token first, then the top ``k``), and the
    chosen token's rank ``[N]`` (1 = most likely)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1  # [N]
    if k == 0:
        return token_ids.unsqueeze(1), chosen, ranks
    top_lp, top_ids = logprobs.topk(k, dim=-1)  # [N, K]
    return torch.cat([token_ids.unsqueeze(1), top_ids], dim=1), torch.cat([chosen, top_lp], dim=1), ranks


def process_logits(
    logits: torch.Tensor, md: SamplingMetadata, failed_rows: dict[int, RequestError] | None = None
) -> torch.Tensor:
    """Every request-specific rewrite of ``logits [B, V]`` (modified in place).

    A logits processor that raises (or returns something that is not a ``[V]``
    tensor) fails its own row, recorded in ``failed_rows``; without that dict
    the exception propagates."""
    neg_inf = float("-inf")
    if md.batch_logits_processors:
        logits = apply_processors(md.batch_logits_processors, logits)
    for row, fn in md.logits_processors:
        try:
            new = fn(logits[row])
            if not isinstance(new, torch.Tensor) or new.shape != logits[row].shape:
                raise TypeError(f"it returned {type(new).__name__} {getattr(new, 'shape', '')}, not a [V] tensor")
            logits[row] = new
        except Exception as e:
            if failed_rows is None:
                raise
            failed_rows[row] = RequestError(f"a logits processor failed: {type(e).__name__}: {e}")
    if md.logit_bias is not None:
        rows, token_ids, bias = md.logit_bias
        logits.index_put_((rows, token_ids), bias, accumulate=True)
    if md.allowed_token_mask is not None:
        rows, allowed = md.allowed_token_mask
        logits[rows] = logits[rows].masked_fill(~allowed, neg_inf)
    if md.banned_token_ids:
        rows = [row for row, ids in md.banned_token_ids for _ in ids]
        token_ids = [t for _, ids in md.banned_token_ids for t in ids]
        logits[torch.tensor(rows, device=logits.device), torch.tensor(token_ids, device=logits.device)] = neg_inf
    if md.token_bitmask is not None:
        apply_token_bitmask(logits, md.token_bitmask)
    if md.penalties is not None:
        p = md.penalties
        logits[p.rows] = apply_penalties(
            logits[p.rows], p.output_counts, p.prompt_mask, p.presence, p.frequency, p.repetition
        )
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every token whose bit is 0 in ``bitmask [B, ceil(V/32)]``
    (bit ``j`` of int32 word ``w`` stands for token ``32 * w + j``)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    allowed = bits.flatten(1)[:, :vocab].to(torch.bool)  # [B, V]
    logits.masked_fill_(~allowed.to(logits.device), float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the top token's."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (0 = all), then the smallest set
    whose probability reaches ``top_p``. Ties at the boundary are kept.

    Without sorting the vocabulary: ``topk`` of the largest ``top_k`` finds each row's
    k-th logit; for ``top_p`` the 256, else 4,096 most likely tokens hold the boundary
    (``TOP_P_CANDIDATES``), and only rows whose boundary lies further are sorted whole.
    A full sort per row cost more than the model's step at large batches on the CPU
    (SmolLM2's 49,152 tokens, 2 threads, 64 rows: top_k 162 ms, top_p 177 ms a step)."""
    vocab = logits.shape[-1]
    if top_k is not None:
        limited = (top_k > 0) & (top_k < vocab)
        if bool(limited.any()):
            k = torch.where(limited, top_k, torch.ones_like(top_k))
            kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
            kth = kth.masked_fill(~limited.unsqueeze(1), float("-inf"))
            logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        logits = _apply_top_p(logits, top_p)
    return logits


# How many of a row's most likely tokens are searched for its top_p boundary, in turn;
# rows whose boundary lies past the last are sorted whole. SmolLM2 at temperature 1 on
# text: 0.9 of the mass lies in a median 14 tokens, past 256 in 20% of positions, past
# 4,096 in none of 216.
TOP_P_CANDIDATES = (256, 4096)


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the tokens whose more likely tokens hold less than ``top_p`` of the mass
    (the most likely always), and any token tied with the last one kept."""
    rows = top_p < 1.0
    if not bool(rows.any()):
        return logits
    probs = logits.softmax(dim=-1)  # [B, V]
    vocab = probs.shape[-1]
    threshold = torch.zeros(probs.shape[0], 1, dtype=probs.dtype, device=probs.device)  # 0: keep everything
    pending, flat = rows.nonzero().flatten(), torch.zeros(0, dtype=torch.long, device=probs.device)
    for size in (*(c for c in TOP_P_CANDIDATES if c < vocab), vocab):
        if size == vocab:
            pending = torch.cat([pending, flat])
        rows_p = probs[pending]
        descending = rows_p.topk(size, dim=-1).values if size < vocab else rows_p.sort(dim=-1, descending=True).values
        before = descending.cumsum(dim=-1) - descending  # each token's more likely tokens' mass
        p = top_p[pending].unsqueeze(1)
        kept = (before < p).sum(dim=-1)  # >= 1
        found = kept < size if size < vocab else torch.ones_like(kept, dtype=torch.bool)
        threshold[pending[found]] = descending[found].gather(1, (kept[found] - 1).unsqueeze(1))
        # a row whose candidates hold under half its top_p is flat: straight to the sort
        very_flat = ~found & (descending.sum(dim=-1) < 0.5 * p.squeeze(1))
        flat = torch.cat([flat, pending[very_flat]])
        pending = pending[~found & ~very_flat]
        if not pending.numel() and not flat.numel():
            break
    return logits.masked_fill(probs < threshold, float("-inf"))
