"""The model runner's view of its requests, and one step's flattened inputs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vframe.core.interfaces import CommonAttentionMetadata
from vframe.core.outputs import NewRequestData, RequestError, SchedulerOutput
from vframe.core.sample.batch_processors import BatchLogitsProcessors
from vframe.core.sample.batch_state import RequestSamplingState, SamplingBatch
from vframe.core.sample.metadata import SamplingMetadata
from vframe.core.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + every sampled token
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    sampling: RequestSamplingState
    lora_int_id: int | None = None  # its LoRA adapter, None: the base model

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class StepInputs:
    req_ids: list[str]
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    common: CommonAttentionMetadata
    sampled_req_ids: list[str]  # requests that reach their last known token this step
    logits_indices: torch.Tensor  # [B_sampled] int64, rows of the hidden states to sample from


class BlockTable:
    """Every known request's block ids as one row of a numpy array kept across steps:
    a step's ``[B, max_blocks]`` table is one gather of rows, not a loop over requests
    (at 1,024 requests the loop took most of a millisecond a step). Entries past a
    request's blocks are 0, as ``CommonAttentionMetadata.block_table`` says."""

    def __init__(self, rows: int = 64, width: int = 16) -> None:
        self.table = np.zeros((rows, width), np.int64)
        self.lens = np.zeros(rows, np.int64)
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(rows - 1, -1, -1))  # pop() -> 0, 1, ...

    def add(self, req_id: str, block_ids: list[int]) -> None:
        row = self.rows.get(req_id)
        if row is None:
            if not self.free_rows:
                grown = len(self.lens)
                self.table = np.concatenate([self.table, np.zeros_like(self.table)])
                self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])
                self.free_rows = list(range(2 * grown - 1, grown - 1, -1))
            row = self.rows[req_id] = self.free_rows.pop()
        self.table[row] = 0
        self.lens[row] = 0
        self.extend(req_id, block_ids)

    def extend(self, req_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        row = self.rows[req_id]
        start = int(self.lens[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            width = max(end, 2 * self.table.shape[1])
            self.table = np.pad(self.table, ((0, 0), (0, width - self.table.shape[1])))
        self.table[row, start:end] = block_ids
        self.lens[row] = end

    def remove(self, req_id: str) -> None:
        row = self.rows.pop(req_id, None)
        if row is not None:
            self.free_rows.append(row)

    def gather(self, req_ids: list[str]) -> np.ndarray:  # [B, max_blocks] int64
        rows = np.fromiter((self.rows[r] for r in req_ids), np.int64, len(req_ids))
        return self.table[rows, : int(self.lens[rows].max())]


class InputBatch:
    """Holds per-request state across steps and turns a ``SchedulerOutput``
    into flat tensors with vectorized numpy (no loop per token)."""

    def __init__(
        self, block_size: int, device: torch.device, batch_processors: BatchLogitsProcessors | None = None
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.requests: dict[str, CachedRequestState] = {}
        self.num_prompt_logprobs = 0  # requests known here that ask for prompt logprobs
        self.block_table = BlockTable()
        self.sampling = SamplingBatch(device, batch_processors)

    def update(self, so: SchedulerOutput) -> dict[str, RequestError]:
        """Apply the scheduler's decision. A new request whose sampling state cannot
        be built (a logits-processor plugin or a grammar raising) is left out of
        the step and returned with the reason; the others run."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            state = self.requests.pop(req_id, None)
            self.block_table.remove(req_id)
            if state is not None:
                self.sampling.remove(state.sampling)
                self.num_prompt_logprobs -= state.sampling_params.prompt_logprobs is not None
        failed: dict[str, RequestError] = {}
        for new in so.scheduled_new_reqs:
            if (known := self.requests.pop(new.req_id, None)) is not None:  # sent anew without leaving first
                self.sampling.remove(known.sampling)
                self.num_prompt_logprobs -= known.sampling_params.prompt_logprobs is not None
            try:
                self.requests[new.req_id] = self._new_state(new)
            except Exception as e:  # noqa: BLE001 - user and plugin code runs in there
                failed[new.req_id] = RequestError(f"setting up sampling failed: {type(e).__name__}: {e}")
                continue
            self.block_table.add(new.req_id, self.requests[new.req_id].block_ids)
            self.num_prompt_logprobs += new.sampling_params.prompt_logprobs is not None
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            self.block_table.extend(cached.req_id, cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        return failed

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        sp: SamplingParams = new.sampling_params  # type: ignore[assignment]
        if self.sampling.batch_processors is not None:
            self.sampling.batch_processors.validate(sp)  # LogitsProcessor.validate_params
        token_ids = list(new.all_token_ids)
        num_prompt_tokens = len(new.prompt_token_ids)
        return CachedRequestState(
            req_id=new.req_id,
            token_ids=token_ids,
            num_prompt_tokens=num_prompt_tokens,
            sampling_params=sp,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            sampling=RequestSamplingState(sp, token_ids, num_prompt_tokens, self.device),
            lora_int_id=None if new.lora_request is None else new.lora_request.lora_int_id,  # type: ignore[attr-defined]
        )

    def prepare(self, so: SchedulerOutput) -> StepInputs:
        req_ids = [r for r in so.num_scheduled_tokens if r in self.requests]  # failed ones are out
        states = [self.requests[r] for r in req_ids]
        num_sched = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), np.int64, len(req_ids))
        context_lens = np.fromiter((s.num_computed_tokens for s in states), np.int64, len(states))
        seq_lens = context_lens + num_sched  # [B]
        query_start_loc = np.zeros(len(req_ids) + 1, np.int64)
        np.cumsum(num_sched, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        # positions: each request's range context_len .. seq_len-1, flattened.  [T]
        req_idx = np.repeat(np.arange(len(req_ids)), num_sched)
        positions = np.arange(num_tokens) - query_start_loc[req_idx] + context_lens[req_idx]

        if num_tokens == len(states):  # one token a request (decodes, mostly): no slices
            tokens = (s.token_ids[c] for s, c in zip(states, context_lens.tolist()))
            input_ids = np.fromiter(tokens, np.int64, num_tokens)
        else:
            input_ids = np.empty(num_tokens, np.int64)
            for i, s in enumerate(states):
                input_ids[query_start_loc[i] : query_start_loc[i + 1]] = s.token_ids[context_lens[i] : seq_lens[i]]

        block_table = self.block_table.gather(req_ids)  # [B, max_blocks]
        bs = self.block_size
        slot_mapping = block_table[req_idx, positions // bs] * bs + positions % bs  # [T]

        is_sampled = seq_lens == np.fromiter((len(s.token_ids) for s in states), np.int64, len(states))
        logits_indices = query_start_loc[1:][is_sampled] - 1

        to = lambda a, dt=torch.int64: torch.from_numpy(a).to(self.device, dt)  # noqa: E731
        common = CommonAttentionMetadata(
            query_start_loc=to(query_start_loc, torch.int32),
            seq_lens=to(seq_lens, torch.int32),
            context_lens=to(context_lens, torch.int32),
            block_table=to(block_table, torch.int32),
            slot_mapping=to(slot_mapping),
            num_reqs=len(req_ids),
            num_actual_tokens=num_tokens,
            max_query_len=int(num_sched.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=bs,
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return StepInputs(
            req_ids=req_ids,
            input_ids=to(input_ids),
            positions=to(positions),
            common=common,
            sampled_req_ids=[r for r, m in zip(req_ids, is_sampled) if m],
            logits_indices=to(logits_indices),
        )

    def lora_segments(self, inputs: StepInputs) -> list[tuple[int, int, int]]:
        """``(first token, end token, lora_int_id)`` of each request of the step
        that runs with an adapter, in token order."""
        qsl = inputs.common.query_start_loc_cpu
        return [
            (qsl[i], qsl[i + 1], lora_id)
            for i, req_id in enumerate(inputs.req_ids)
            if (lora_id := self.requests[req_id].lora_int_id) is not None and qsl[i + 1] > qsl[i]
        ]

    def sampling_metadata(self, req_ids: list[str], vocab_size: int) -> SamplingMetadata:
        return self.sampling.metadata([self.requests[r].sampling for r in req_ids], vocab_size)

    def record_sampled(self, req_ids: list[str], token_ids: list[int]) -> dict[str, RequestError]:
        """Append each request's sampled token to its state; returns the requests
        whose grammar refused its token (those must not go on)."""
        states = [self.requests[r].sampling for r in req_ids]
        refused = self.sampling.record_sampled(states, token_ids)
        return {req_ids[i]: error for i, error in refused.items()}

    def prompt_logprobs_rows(self, inputs: StepInputs) -> list[tuple[str, int, list[int], list[int], int]]:
        """Requests that asked for prompt logprobs and run prompt tokens this step:
        ``(req_id, first position, rows of the step's hidden states, target token ids, k)``.

        The hidden state at position ``p`` predicts prompt token ``p + 1``; the last
        prompt position predicts the first output token and is not a prompt logprob.
        A chunked prefill yields its positions chunk by chunk."""
        found: list[tuple[str, int, list[int], list[int], int]] = []
        if not self.num_prompt_logprobs:  # no request asks: no loop over the step's requests
            return found
        for i, req_id in enumerate(inputs.req_ids):
            state = self.requests[req_id]
            if state.sampling_params.prompt_logprobs is None or state.num_output_tokens:
                continue
            start = inputs.common.query_start_loc_cpu[i]
            seq_len = inputs.common.seq_lens_cpu[i]
            context_len = seq_len - (inputs.common.query_start_loc_cpu[i + 1] - start)
            end = min(seq_len, state.num_prompt_tokens - 1)
            if end > context_len:
                rows = list(range(start, start + end - context_len))
                targets = state.token_ids[context_len + 1 : end + 1]
                found.append((req_id, context_len + 1, rows, targets, state.sampling_params.prompt_logprobs))
        return found
