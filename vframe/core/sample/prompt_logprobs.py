"""Prompt logprobs: the output head on a request's prompt rows, only for requests
that ask (``SamplingParams.prompt_logprobs``), in slices so a long prompt never
materializes ``[prompt_len, V]`` logits at once."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vframe.core.outputs import PromptLogprobsChunk
from vframe.core.sample.sampler import gather_logprobs

_ROWS_PER_SLICE = 256


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    requests: list[tuple[str, int, list[int], list[int], int]],
) -> dict[str, PromptLogprobsChunk]:
    """``hidden [T, E]``: the step's hidden states. ``requests``: per request
    ``(req_id, first position, rows of hidden, target token ids, k)``."""
    chunks: dict[str, PromptLogprobsChunk] = {}
    for req_id, start, rows, targets, k in requests:
        chunk = PromptLogprobsChunk(start=start, token_ids=[], logprobs=[], ranks=[])
        for lo in range(0, len(rows), _ROWS_PER_SLICE):
            idx = torch.tensor(rows[lo : lo + _ROWS_PER_SLICE], device=hidden.device)
            logprobs = torch.log_softmax(compute_logits(hidden[idx]).float(), dim=-1)  # [N, V]
            target = torch.tensor(targets[lo : lo + _ROWS_PER_SLICE], device=hidden.device)
            ids, lps, ranks = gather_logprobs(logprobs, target, k)
            chunk.token_ids += ids.tolist()
            chunk.logprobs += lps.tolist()
            chunk.ranks += ranks.tolist()
        chunks[req_id] = chunk
    return chunks
