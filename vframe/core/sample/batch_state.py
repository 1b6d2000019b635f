"""The model runner's sampling state: per request, and the step's ``SamplingMetadata``.

Everything here derives from a request's ``SamplingParams`` and its token ids,
so a request the scheduler preempts and sends again is rebuilt exactly: its
seeded generator is replayed by the number of tokens it already drew, its
grammar matcher re-reads its output, its penalty counts are recounted.

The step's metadata is built by ``SamplingBatch.metadata``. Plain requests
(temperature, top-k/p, min-p, seed, logprobs) cost a few list comprehensions;
the per-request extras (penalties, bias, allowed ids, bad words, min_tokens,
logits processors, structured output) are gathered only for the rows that use
them, and not at all when no row does.
"""

from __future__ import annotations

import torch

from vframe.core.outputs import RequestError
from vframe.core.sample.batch_processors import BatchLogitsProcessors
from vframe.core.sample.logits_processors import RequestLogitsProcessors
from vframe.core.sample.metadata import PenaltyInputs, SamplingMetadata
from vframe.core.sample.penalties import PenaltyCounts
from vframe.core.sample.structured import GrammarMatcher, StructuredOutputBackend, bitmask_words
from vframe.core.sampling_params import SamplingParams, SamplingType


class RequestSamplingState:
    """One request's sampling state in the runner, beside its token ids."""

    def __init__(
        self, params: SamplingParams, token_ids: list[int], num_prompt_tokens: int, device: torch.device
    ) -> None:
        self.params = params
        self.token_ids = token_ids  # the runner's list: prompt + sampled, appended each step
        self.num_prompt_tokens = num_prompt_tokens
        self.generator: torch.Generator | None = None
        # Draws the seeded generator must skip: one per token sampled before a preemption.
        self.num_draws_to_replay = 0
        if params.sampling_type == SamplingType.RANDOM_SEED:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)
            self.num_draws_to_replay = self.num_output_tokens
        self.grammar: GrammarMatcher | None = None
        if params._grammar is not None:
            self.grammar = params._grammar.new_matcher()
            for token_id in self.output_token_ids:
                self.grammar.accept_token(token_id)
        self.logits_processors: RequestLogitsProcessors | None = None
        if params._logits_processor_factories:
            self.logits_processors = RequestLogitsProcessors(
                params._logits_processor_factories, token_ids, num_prompt_tokens
            )
        self.has_penalties = (
            params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0
        )
        self.penalty_row: int | None = None  # in SamplingBatch.penalty_counts, given on first use
        self.allowed_mask: torch.Tensor | None = None  # [V] bool, built on first use
        # The output tokens as one list that grows each step, for batch-level logits
        # processors (vLLM hands them a live list); made on first use.
        self._live_output: list[int] | None = None
        self.needs_processing = bool(
            self.has_penalties
            or params.logit_bias
            or params.allowed_token_ids
            or params.bad_words_token_ids
            or (params.min_tokens and params.all_stop_token_ids)
            or self.grammar is not None
            or self.logits_processors is not None
        )
        # A greedy request that asks for nothing else: a batch of only these needs no
        # per-row parameters (SamplingBatch.metadata's fast path).
        self.plain_greedy = (
            params.sampling_type == SamplingType.GREEDY and params.top_k <= 0 and params.top_p >= 1.0
            and params.min_p <= 0.0 and params.logprobs is None and not self.needs_processing
        )  # fmt: skip

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def live_output_token_ids(self) -> list[int]:
        if self._live_output is None:
            self._live_output = self.output_token_ids
        return self._live_output

    def banned_token_ids(self) -> list[int]:
        """End-of-sequence ids before ``min_tokens``; the last token of each bad word
        whose other tokens end the output (vLLM's rule: only the output counts)."""
        sp = self.params
        banned: list[int] = []
        if self.num_output_tokens < sp.min_tokens:
            banned.extend(sorted(sp.all_stop_token_ids))
        for word in sp.bad_words_token_ids:
            prefix = word[:-1]
            if len(prefix) > self.num_output_tokens:
                continue
            if not prefix or self.token_ids[len(self.token_ids) - len(prefix) :] == prefix:
                banned.append(word[-1])
        return banned


class SamplingBatch:
    """Builds each step's ``SamplingMetadata`` and records the sampled tokens."""

    def __init__(self, device: torch.device, batch_processors: BatchLogitsProcessors | None = None) -> None:
        self.device = device
        self.penalty_counts: PenaltyCounts | None = None  # allocated with the first penalty
        self.batch_processors = batch_processors  # engine-wide ones (LLM(logits_processors=...))

    def remove(self, state: RequestSamplingState) -> None:
        if state.penalty_row is not None and self.penalty_counts is not None:
            self.penalty_counts.free(state.penalty_row)
            state.penalty_row = None

    def metadata(self, states: list[RequestSamplingState], vocab_size: int) -> SamplingMetadata:
        if all(s.plain_greedy for s in states):  # the common batch: no list, no host-to-device copy
            ones = torch.ones(len(states), dtype=torch.float32, device=self.device)
            md = SamplingMetadata(temperature=ones, greedy_mask=ones.bool(), all_greedy=True)
            self._add_batch_processors(md, states)
            return md
        params = [s.params for s in states]
        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        dev = self.device
        md = SamplingMetadata(
            temperature=torch.tensor(
                [1.0 if g else p.temperature for g, p in zip(greedy, params)], dtype=torch.float32, device=dev
            ),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=dev),
            all_greedy=all(greedy),
        )
        if any(p.top_k > 0 for p in params):
            md.top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev)
        if any(p.top_p < 1.0 for p in params):
            md.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        if any(p.min_p > 0.0 for p in params):
            md.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        md.generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        for i in md.generators:
            self._replay_draws(states[i], vocab_size)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        md.max_num_logprobs = max(asked) if asked else None
        if any(s.needs_processing for s in states):
            self._add_processing(md, states, vocab_size)
        self._add_batch_processors(md, states)
        return md

    def _add_batch_processors(self, md: SamplingMetadata, states: list[RequestSamplingState]) -> None:
        if self.batch_processors is not None:
            self.batch_processors.update(states)
            md.batch_logits_processors = self.batch_processors.non_argmax_invariant
            md.argmax_invariant_logits_processors = self.batch_processors.argmax_invariant

    def _replay_draws(self, state: RequestSamplingState, vocab_size: int) -> None:
        """Advance a re-admitted seeded request's generator past the draws it made
        before its preemption: one float64 uniform per sampled token
        (``vframe.core.sample.sampler.sample_from_probs``), drawn as it draws them."""
        for _ in range(state.num_draws_to_replay):
            torch.rand(1, dtype=torch.float64, generator=state.generator, device=self.device)
        state.num_draws_to_replay = 0

    def _add_processing(self, md: SamplingMetadata, states: list[RequestSamplingState], vocab_size: int) -> None:
        dev = self.device
        rows = [i for i, s in enumerate(states) if s.needs_processing]
        md.logits_processors = [
            (i, states[i].logits_processors) for i in rows if states[i].logits_processors is not None
        ]
        md.banned_token_ids = [(i, ids) for i in rows if (ids := states[i].banned_token_ids())]

        bias_rows = [i for i in rows if states[i].params.logit_bias]
        if bias_rows:
            items = [(i, t, b) for i in bias_rows for t, b in states[i].params.logit_bias.items()]
            r, t, b = zip(*items)
            md.logit_bias = (
                torch.tensor(r, device=dev),
                torch.tensor(t, device=dev),
                torch.tensor(b, dtype=torch.float32, device=dev),
            )

        allowed_rows = [i for i in rows if states[i].params.allowed_token_ids]
        if allowed_rows:
            for i in allowed_rows:
                if states[i].allowed_mask is None:
                    mask = torch.zeros(vocab_size, dtype=torch.bool, device=dev)
                    mask[states[i].params.allowed_token_ids] = True
                    states[i].allowed_mask = mask
            md.allowed_token_mask = (
                torch.tensor(allowed_rows, device=dev),
                torch.stack([states[i].allowed_mask for i in allowed_rows]),  # [A, V]
            )

        grammar_rows = [i for i in rows if states[i].grammar is not None]
        if grammar_rows:
            md.token_bitmask = self._grammar_bitmask(states, grammar_rows, vocab_size).to(dev)

        penalty_rows = [i for i in rows if states[i].has_penalties]
        if penalty_rows:
            md.penalties = self._penalty_inputs(states, penalty_rows, vocab_size)

    def _grammar_bitmask(
        self, states: list[RequestSamplingState], rows: list[int], vocab_size: int
    ) -> torch.Tensor:
        bitmask = torch.full((len(states), bitmask_words(vocab_size)), -1, dtype=torch.int32)  # [B, W]
        by_backend: dict[int, tuple[StructuredOutputBackend, list[tuple[GrammarMatcher, int]]]] = {}
        for i in rows:
            grammar = states[i].grammar
            backend = states[i].params._grammar.backend
            by_backend.setdefault(id(backend), (backend, []))[1].append((grammar, i))
        for backend, matchers in by_backend.values():
            backend.fill_bitmask(matchers, bitmask)
        return bitmask

    def _penalty_inputs(
        self, states: list[RequestSamplingState], rows: list[int], vocab_size: int
    ) -> PenaltyInputs:
        if self.penalty_counts is None:
            self.penalty_counts = PenaltyCounts(vocab_size, self.device)
        counts = self.penalty_counts
        for i in rows:
            s = states[i]
            if s.penalty_row is None:
                s.penalty_row = counts.add(s.token_ids[: s.num_prompt_tokens], s.output_token_ids)
        slots = torch.tensor([states[i].penalty_row for i in rows], device=self.device)
        params = [states[i].params for i in rows]

        def per_row(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=self.device)

        return PenaltyInputs(
            rows=torch.tensor(rows, device=self.device),
            presence=per_row([p.presence_penalty for p in params]),
            frequency=per_row([p.frequency_penalty for p in params]),
            repetition=per_row([p.repetition_penalty for p in params]),
            output_counts=counts.output_counts.index_select(0, slots),  # [P, V]
            prompt_mask=counts.prompt_mask.index_select(0, slots),  # [P, V]
        )

    def record_sampled(self, states: list[RequestSamplingState], sampled: list[int]) -> dict[int, RequestError]:
        """Append each request's sampled token; advance grammars and penalty counts.
        Returns the rows whose grammar refused (or failed on) the token."""
        penalty_slots: list[int] = []
        penalty_tokens: list[int] = []
        refused: dict[int, RequestError] = {}
        for row, (state, token_id) in enumerate(zip(states, sampled)):
            state.token_ids.append(token_id)
            if state._live_output is not None:
                state._live_output.append(token_id)
            if state.needs_processing:
                if state.grammar is not None:
                    try:
                        accepted = state.grammar.accept_token(token_id)
                    except Exception as e:  # noqa: BLE001 - the grammar library is plugin code
                        accepted, why = False, f"{type(e).__name__}: {e}"
                    else:
                        why = "the sampled token is not allowed by the grammar"
                    if not accepted:
                        refused[row] = RequestError(f"structured output failed at token {token_id}: {why}")
                if state.penalty_row is not None:
                    penalty_slots.append(state.penalty_row)
                    penalty_tokens.append(token_id)
        if penalty_slots:
            self.penalty_counts.record(
                torch.tensor(penalty_slots, device=self.device), torch.tensor(penalty_tokens, device=self.device)
            )
        return refused
