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
    """One token's log probability at one position (vLLM's ``Logprob``).

    Attributes:
        logprob: natural-log probability under the model's raw distribution
            (before temperature, penalties and other logits rewrites).
        rank: the token's rank at that position, 1 = most likely.
        decoded_token: the token's text; ``None`` when it is not decoded
            (``detokenize=False``, or the engine has no tokenizer).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class RequestError:
    """Why the engine gave up on one completion (``finish_reason="error"``).

    Either way only this request ends; every other request goes on.

    Attributes:
        message: what went wrong, for the user (``str(error)`` returns it).
        caused_by_request: ``True`` when the request's own parameters made it
            impossible (its constraints leave no token allowed): a client error,
            HTTP 400 when served. ``False`` when a plugin or the engine failed
            (HTTP 500).
    """

    message: str
    caused_by_request: bool = False

    def __str__(self) -> str:
        return self.message


# One dict per generated position: token id -> Logprob (chosen token + top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One completion of a request, as the user sees it.

    With ``output_kind="delta"`` the text, token ids and logprobs hold only what
    is new since the previous output; otherwise everything so far.

    Attributes:
        index: which of the request's ``n`` completions, ``0 .. n-1`` (with
            ``best_of > n``: renumbered best first when the request finishes).
        text: the detokenized output; ``""`` when ``detokenize=False`` or the
            engine has no tokenizer.
        token_ids: the generated token ids (the prompt not included).
        cumulative_logprob: sum of the sampled tokens' logprobs; ``None`` unless
            the request asked for ``logprobs``.
        logprobs: one ``{token_id: Logprob}`` per generated token (the sampled
            token and the top ``logprobs`` ones); ``None`` unless asked for.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"``;
            ``None`` while the completion goes on.
        stop_reason: the stop token id (from ``stop_token_ids``) or the stop
            string that ended it; ``None`` otherwise (end-of-sequence included).
        error: why the engine gave up on it, with ``finish_reason="error"``:
            a logits processor or grammar that raised, or constraints that leave
            no token allowed. ``None`` otherwise.
    """

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
        """Whether ``finish_reason`` is set."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns and ``AsyncLLMEngine.generate`` yields for one request.

    Attributes:
        request_id: the id the request was added with.
        prompt: the prompt text, ``None`` when the request was given token ids.
        prompt_token_ids: the tokenized prompt.
        outputs: the completions, ordered by ``CompletionOutput.index``. While
            streaming, those that have produced output so far (with
            ``output_kind="delta"``: those with news since the last output).
        finished: whether every completion has finished.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: one
            ``{token_id: Logprob}`` per prompt token, ``None`` for the first
            (nothing predicts it); ``None`` otherwise.
        num_cached_tokens: prompt tokens served from the prefix cache (the
            largest count over the request's completions).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0


class FinishReason(str, Enum):
    """Why a request stopped; compares equal to its string value.

    Attributes:
        STOP: ``"stop"``: an end-of-sequence or stop token (after ``min_tokens``),
            a stop string, or a complete grammar.
        LENGTH: ``"length"``: ``max_tokens`` or ``max_model_len`` reached.
        ABORT: ``"abort"``: cancelled (``abort_request``, a client disconnect,
            a server shutdown).
        ERROR: ``"error"``: the engine gave up on this request alone
            (``RequestError`` says why).
    """

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


# --------------------------------------------------------------------------- #
# internal
# --------------------------------------------------------------------------- #


@dataclass
class NewRequestData:
    """A request the runner has not seen yet, or sees again after a preemption
    (which makes the runner drop everything it held for the request).

    Attributes:
        req_id: the engine-core request id (for ``n > 1`` one per completion:
            ``"{index}_{request_id}"``).
        prompt_token_ids: the prompt. The scheduler's own list: read it, never
            change it.
        all_token_ids: prompt plus every token generated before a preemption
            (a copy, equal to ``prompt_token_ids`` on first scheduling).
        sampling_params: the request's ``SamplingParams`` (typed ``object`` so
            this module needs no import of it).
        block_ids: the request's whole block table after this step's
            allocation (``KVCacheManager.get_block_ids``): prefix-cache hits
            first, then newly allocated blocks. A swapped-in request's KV is in
            its blocks once ``blocks_to_swap_in`` is copied.
        num_computed_tokens: tokens whose KV is in the cache when the step
            starts (prefix-cache hits included); this step computes
            ``num_scheduled_tokens[req_id]`` more from there.
        num_output_tokens: ``len(all_token_ids) - len(prompt_token_ids)``,
            the tokens generated before a preemption.
        lora_request: the request's ``LoRARequest``, ``None`` for the base
            model (plugin API 1.3; typed ``object`` as ``sampling_params``).
    """

    req_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int]  # prompt + tokens generated before a preemption
    sampling_params: object  # SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_output_tokens: int = 0
    lora_request: object = None  # LoRARequest | None


@dataclass
class CachedRequestData:
    """A request the runner already holds: what changed since the last step.

    Attributes:
        req_id: the engine-core request id.
        new_block_ids: block ids appended to the request's block table for this
            step; often empty (the last block still has room).
        num_computed_tokens: tokens whose KV is in the cache when the step
            starts; this step computes ``num_scheduled_tokens[req_id]`` more.
    """

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    """One step's decision. ``num_scheduled_tokens[req_id]`` tokens of each
    request run now, starting at its ``num_computed_tokens``.

    Attributes:
        scheduled_new_reqs: requests the runner holds no state for: scheduled
            for the first time, or again after a preemption. Sent in full.
        scheduled_cached_reqs: requests the runner already holds, with what
            changed since the step that last ran them.
        num_scheduled_tokens: ``req_id -> tokens it runs this step`` (each at
            least 1), for every request of the two lists above. The built-in
            runner orders the batch's rows as this dict is ordered (the default
            scheduler: running requests, then newly admitted ones).
        total_num_scheduled_tokens: the sum of ``num_scheduled_tokens``: ``T``,
            the step's token count.
        preempted_req_ids: requests preempted by this step's decision
            (recomputed or swapped out); the runner drops their state, they
            come back later in ``scheduled_new_reqs``.
        finished_req_ids: requests the runner holds that finished (or were
            aborted or failed) since the previous ``schedule()``; the runner
            drops their state.
        blocks_to_swap_out: ``(device block, swap block)`` copies to make before
            this step's forward pass.
        blocks_to_swap_in: ``(swap block, device block)`` copies to make after
            the swap-outs, before this step's forward pass.
    """

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
    """What a sampler returns for the ``[B, V]`` logits it was given: row ``i``
    belongs to row ``i`` of the ``SamplingMetadata``.

    Attributes:
        sampled_token_ids: ``[B]`` int64, on the logits' device: each row's token.
        logprob_token_ids: ``[B, 1 + K]`` int64, ``K = max_num_logprobs``: the
            sampled token, then the ``K`` most likely. ``None`` unless some row
            asked for logprobs (``max_num_logprobs`` is not ``None``); rows that
            asked for fewer are cut by the runner.
        logprobs: ``[B, 1 + K]`` float32, the log probabilities of
            ``logprob_token_ids`` under the model's raw distribution (before
            any logits rewrite); ``None`` with ``logprob_token_ids``.
        sampled_ranks: ``[B]`` int64, the sampled token's rank under that
            distribution (1 = most likely); ``None`` with ``logprob_token_ids``.
        failed_rows: ``row -> why`` for rows whose request-specific code (a
            logits processor) raised; their sampled token is meaningless and
            the runner fails those requests alone.
        no_valid_token_rows: rows, ascending, where every logit ended up at
            ``-inf`` (allowed ids, bad words, ``min_tokens`` and a grammar that
            exclude each other): nothing could be sampled there.
    """

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
    and are absent from ``sampled_token_ids``.

    Attributes:
        req_ids: the requests that ran in the step, in batch row order; ``[]``
            when nothing ran. A new request whose sampling setup failed is in
            ``failed`` instead.
        sampled_token_ids: ``req_id -> token id`` for each request that reached
            its last known token and goes on; requests in ``failed`` or
            ``stopped`` are absent.
        logprobs: ``req_id -> (token ids [1 + K], logprobs [1 + K], rank)`` for
            requests with ``SamplingParams.logprobs = K``: the sampled token
            first, then the ``K`` most likely; ``rank`` is the sampled token's
            (1 = most likely).
        prompt_logprobs: ``req_id -> the prompt positions computed this step``,
            for requests with ``SamplingParams.prompt_logprobs``.
        failed: ``req_id -> why`` for requests that cannot go on; only they
            fail, the step stands.
        stopped: requests whose grammar is complete while something else
            (``min_tokens``, a ban) forbids its end-of-sequence token: they stop
            here, without a new token.
    """

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
    position the actual prompt token first, then the top K, and its rank.

    A chunked prefill yields one chunk per step; ``K`` is the request's
    ``SamplingParams.prompt_logprobs``.

    Attributes:
        start: prompt position of the first entry (position 0 has no logprob:
            nothing predicts it).
        token_ids: ``[N][1 + K]``: the prompt token, then the ``K`` most likely.
        logprobs: ``[N][1 + K]``: their log probabilities.
        ranks: ``[N]``: each prompt token's rank (1 = most likely).
    """

    start: int
    token_ids: list[list[int]]  # [N][1 + K]
    logprobs: list[list[float]]  # [N][1 + K]
    ranks: list[int]  # [N]


@dataclass
class EngineCoreOutput:
    """What the scheduler reports for one request after a step.

    Attributes:
        req_id: the engine-core request id (for ``n > 1`` one per completion:
            ``"{index}_{request_id}"``).
        new_token_ids: the token sampled this step, or ``[]`` (a request that
            finishes without a new token: failed, or stopped by its grammar).
        new_logprobs: one ``(token ids [1 + K], logprobs [1 + K], rank)`` per new
            token, as in ``ModelRunnerOutput.logprobs``; ``None`` unless the
            request asked for logprobs.
        finish_reason: set when the request finished in this step, else ``None``.
        stop_reason: the token id from ``stop_token_ids`` that stopped it; ``None``
            otherwise (end-of-sequence tokens included). Stop strings are found
            later, by the output processor.
        num_cached_tokens: prompt tokens served from the prefix cache.
        error: why the request failed, with ``finish_reason`` ``ERROR``; else ``None``.
    """

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: RequestError | None = None  # with finish_reason ERROR

    @property
    def finished(self) -> bool:
        """Whether ``finish_reason`` is set."""
        return self.finish_reason is not None
