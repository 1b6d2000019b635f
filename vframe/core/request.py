"""A request's lifecycle inside the engine core."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from vframe.core.outputs import FinishReason
from vframe.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vframe.lora.request import LoRARequest


class RequestStatus(enum.IntEnum):
    """Where a request is in its lifecycle; every member after ``SWAPPED`` is finished.

    Attributes:
        WAITING: queued, not yet admitted.
        RUNNING: admitted: it holds KV blocks and is scheduled every step the
            token budget allows.
        PREEMPTED: its blocks were freed; waiting to be admitted again and
            recomputed.
        SWAPPED: its blocks were copied to the swap space; waiting to be
            copied back.
        FINISHED_STOPPED: finished with ``finish_reason="stop"``.
        FINISHED_LENGTH_CAPPED: finished with ``finish_reason="length"``.
        FINISHED_ABORTED: finished with ``finish_reason="abort"``.
        FINISHED_IGNORED: finished with ``finish_reason="length"`` without
            running (no scheduler in vframe sets it today).
        FINISHED_ERROR: failed alone, ``finish_reason="error"``: a plugin
            raised, or no token was allowed.
    """

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # blocks freed; recomputed when readmitted
    SWAPPED = enum.auto()  # blocks copied to the swap space; copied back when readmitted
    # Everything after this line is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()  # failed alone: a plugin raised, or no token was allowed

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """Whether ``status`` is one of the ``FINISHED_*`` members."""
        return status > RequestStatus.SWAPPED

    @staticmethod
    def finish_reason(status: RequestStatus) -> FinishReason | None:
        """The ``FinishReason`` of a finished status; ``None`` for the others."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One sequence being generated.

    ``num_computed_tokens`` counts tokens whose KV is in the cache; the
    scheduler's job each step is to bring it closer to ``num_tokens``::

        | prompt ........ | output ... |
        |<- num_computed_tokens ->|    |
        |<------- num_tokens --------->|

    The engine makes one per completion (``n > 1`` gives ``n`` requests) and
    hands it to the scheduler, which owns it from then on; a KV cache manager
    and a scheduling policy only read it.

    Attributes:
        request_id (str): the engine-core id: the user's request id, or
            ``"{index}_{request_id}"`` for one of several completions.
        prompt_token_ids (list[int]): the tokenized prompt.
        sampling_params (SamplingParams): the request's sampling parameters.
        arrival_time (float): ``time.monotonic()`` when it entered the engine,
            unless the caller of ``LLMEngine.add_request`` passed its own.
        priority (int): the user's priority, ``0`` unless set; lower runs first
            under the ``priority`` policy.
        cache_salt (str | None): part of every block hash: requests with
            different salts never share prefix-cache blocks.
        lora_request (LoRARequest | None): the LoRA adapter it runs with
            (plugin API 1.3); its ``lora_int_id`` is part of every block hash,
            so requests with different adapters never share prefix-cache blocks.
        lora_int_id (int | None): ``lora_request.lora_int_id``, ``None`` for
            the base model.
        max_tokens (int): most tokens it may generate, already capped by the
            engine so that prompt plus output fit ``max_model_len``.
        status (RequestStatus): where it is in its lifecycle.
        output_token_ids (list[int]): the tokens generated so far.
        all_token_ids (list[int]): prompt plus generated tokens.
        num_computed_tokens (int): tokens whose KV is in the cache (or, for a
            request scheduled this step, will be once the step has run).
            Reset to 0 when it is preempted by recomputation.
        num_cached_tokens (int): prompt tokens served from the prefix cache.
        num_preemptions (int): how often it was preempted.
        stop_reason (int | str | None): the token id from ``stop_token_ids``
            that stopped it; ``None`` otherwise.
        num_prompt_tokens (int): ``len(prompt_token_ids)``.
        num_tokens (int): ``len(all_token_ids)``.
        num_output_tokens (int): ``len(output_token_ids)``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        max_tokens: int | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        # Part of every block hash: requests with different salts never share KV.
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        # max_tokens resolved against max_model_len by the engine.
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None

    @property
    def lora_int_id(self) -> int | None:
        """The adapter's id, ``None`` for the base model."""
        return None if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        """Record generated tokens (in ``output_token_ids`` and ``all_token_ids``)."""
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        """Whether ``status`` is one of the ``FINISHED_*`` members."""
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> FinishReason | None:
        """The ``FinishReason`` of its status; ``None`` while it is not finished."""
        return RequestStatus.finish_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
