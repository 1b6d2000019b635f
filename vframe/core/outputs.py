"""Value objects that cross the engine's layers.

User-facing: ``RequestOutput``, ``CompletionOutput``, ``Logprob`` (vLLM's names).
Internal: ``SchedulerOutput`` (scheduler -> runner), ``ModelRunnerOutput``
(runner -> scheduler), ``SamplerOutput`` (sampler -> runner), ``EngineCoreOutput``
(scheduler -> engine output processing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

# --------------------------------------------------------------------------- #
# user-facing
# --------------------------------------------------------------------------- #


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class RequestError:
    """Why the engine gave up on one completion (``finish_reason="error"``).

    ``caused_by_request``: the request's own parameters made it impossible (its
    constraints leave no token allowed) -- a client error, HTTP 400 when served;
    otherwise a plugin or the engine failed (HTTP 500). Either way only this
    request ends; every other request goes on."""

    message: str
    caused_by_request: bool = False

    def __str__(self) -> str:
        return self.message


# One dict per generated position: token id -> Logprob (chosen token + top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    # Why the engine gave up on this completion (finish_reason "error"): a logits
    # processor or grammar that raised, or constraints that leave no token allowed.
    error: RequestError | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


# --------------------------------------------------------------------------- #
# internal
# --------------------------------------------------------------------------- #


@dataclass
class NewRequestData:
    """A request the runner has not seen yet (or sees again after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int]  # prompt + tokens generated before a preemption
    sampling_params: object  # SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_output_tokens: int = 0


@dataclass
class CachedRequestData:
    """A request the runner already holds: what changed since the last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    """One step's decision. ``num_scheduled_tokens[req_id]`` tokens of each
    request run now, starting at its ``num_computed_tokens``."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str] = field(default_factory=set)  # recomputed or swapped out
    finished_req_ids: set[str] = field(default_factory=set)
    # (device block, swap block) to copy out, then (swap block, device block) to copy
    # in, before this step's forward pass.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing runs and nothing moves: no tokens, no preemptions, no swaps."""
        return (
            self.total_num_scheduled_tokens == 0
            and not self.preempted_req_ids
            and not self.blocks_to_swap_out
            and not self.blocks_to_swap_in
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # Filled only when a request in the batch asked for logprobs.
    logprob_token_ids: torch.Tensor | None = None  # [B, 1 + K] chosen token first
    logprobs: torch.Tensor | None = None  # [B, 1 + K]
    sampled_ranks: torch.Tensor | None = None  # [B] rank of the chosen token (1 = most likely)
    # Rows whose request-specific code (a logits processor) raised: row -> why.
    # Their sampled token is meaningless; the runner fails those requests alone.
    failed_rows: dict[int, RequestError] = field(default_factory=dict)
    # Rows where every token ended up at -inf (allowed ids, bad words, min_tokens and
    # a grammar that exclude each other): nothing can be sampled.
    no_valid_token_rows: list[int] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    """Per request that reached the end of its scheduled tokens: the sampled token.

    Requests still in the middle of a chunked prefill sample nothing this step
    and are absent from ``sampled_token_ids``."""

    req_ids: list[str]
    sampled_token_ids: dict[str, int]
    # req_id -> (token ids [1 + K], logprobs [1 + K], rank of chosen)
    logprobs: dict[str, tuple[list[int], list[float], int]] = field(default_factory=dict)
    # req_id -> the prompt positions computed this step, for requests with prompt_logprobs
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # Requests that cannot go on (req_id -> why); only they fail, the step stands.
    failed: dict[str, RequestError] = field(default_factory=dict)
    # Requests whose grammar is complete while something else (min_tokens, a ban)
    # forbids its end-of-sequence token: they stop here, without a new token.
    stopped: set[str] = field(default_factory=set)


@dataclass
class PromptLogprobsChunk:
    """Logprobs of prompt tokens ``start .. start + N - 1`` (``start >= 1``): per
    position the actual prompt token first, then the top K, and its rank."""

    start: int
    token_ids: list[list[int]]  # [N][1 + K]
    logprobs: list[list[float]]  # [N][1 + K]
    ranks: list[int]  # [N]


@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: RequestError | None = None  # with finish_reason ERROR

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
