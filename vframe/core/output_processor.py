"""Turns the core's new token ids into user-facing ``RequestOutput``s.

One user request with ``n`` completions is ``n`` core requests (children) whose
``CompletionOutput``s are gathered under the parent's id; with ``best_of > n``
there are ``best_of`` children and the ``n`` with the highest cumulative logprob
are returned, renumbered 0..n-1 best first. Prompt logprobs arrive from the
model runner chunk by chunk and are kept per parent, by prompt position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vframe.core.detokenizer import IncrementalDetokenizer
from vframe.core.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    PromptLogprobsChunk,
    RequestError,
    RequestOutput,
)
from vframe.core.sampling_params import SamplingParams


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    children: dict[str, int] = field(default_factory=dict)  # child id -> completion index
    num_finished: int = 0
    num_cached_tokens: int = 0
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    # One entry per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def __post_init__(self) -> None:
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)


class CompletionState:
    """One child's accumulated tokens, text and logprobs."""

    def __init__(self, parent: ParentRequest, index: int, tokenizer) -> None:
        self.parent = parent
        self.index = index
        sp = parent.sampling_params
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if sp.logprobs is not None else None
        # best_of > n ranks completions by it even when logprobs were not asked for.
        ranked = (sp.best_of or sp.n) > sp.n
        self.cumulative_logprob: float | None = 0.0 if sp.logprobs is not None or ranked else None
        self.detokenizer: IncrementalDetokenizer | None = None
        self.tokenizer = tokenizer
        # Detokenize every step only when someone looks at the text before the end.
        self.incremental = tokenizer is not None and sp.detokenize and (
            bool(sp.stop) or sp.output_kind != "final"
        )
        if tokenizer is not None and sp.detokenize:
            self.detokenizer = IncrementalDetokenizer(
                tokenizer,
                parent.prompt_token_ids,
                skip_special_tokens=sp.skip_special_tokens,
                spaces_between_special_tokens=sp.spaces_between_special_tokens,
                stop=sp.stop,
                include_stop_str_in_output=sp.include_stop_str_in_output,
            )
        self._num_sent_tokens = 0

    def add(self, out: EngineCoreOutput) -> str | None:
        """Record new tokens; return a stop string if one ended the text."""
        self.token_ids.extend(out.new_token_ids)
        if self.cumulative_logprob is not None and out.new_logprobs:
            for ids, lps, rank in out.new_logprobs:
                self.cumulative_logprob += lps[0]
                if self.logprobs is not None:
                    tokenizer = self.tokenizer if self.parent.sampling_params.detokenize else None
                    self.logprobs.append(logprob_entry(ids, lps, rank, tokenizer))
        if self.incremental:
            return self.detokenizer.update(out.new_token_ids)
        return None

    def completion(
        self, finish_reason: str | None, stop_reason, delta: bool, error: RequestError | None = None
    ) -> CompletionOutput:
        if self.detokenizer is not None and not self.incremental and finish_reason is not None:
            self.detokenizer.update(self.token_ids, stop_checked=False)
        text = (
            self.detokenizer.get_next_output_text(finish_reason is not None, delta)
            if self.detokenizer is not None
            else ""
        )
        token_ids = self.token_ids
        logprobs = self.logprobs
        if delta:
            token_ids = token_ids[self._num_sent_tokens :]
            if logprobs is not None:
                logprobs = logprobs[self._num_sent_tokens :]
            self._num_sent_tokens = len(self.token_ids)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            error=error,
        )


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self.states: dict[str, CompletionState] = {}  # child id -> state

    def add_request(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent
        for child_id, index in parent.children.items():
            self.states[child_id] = CompletionState(parent, index, self.tokenizer)

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def is_in_use(self, request_id: str) -> bool:
        """Whether a request or one of its completions in flight has this id."""
        return request_id in self.parents or request_id in self.states

    def process(
        self,
        outputs: list[EngineCoreOutput],
        prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None,
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to hand to users and the child ids stopped by a stop string."""
        for child_id, chunk in (prompt_logprobs or {}).items():
            if (state := self.states.get(child_id)) is not None:
                self._add_prompt_logprobs(state.parent, chunk)
        stopped: list[str] = []
        touched: dict[str, ParentRequest] = {}
        for out in outputs:
            state = self.states.get(out.req_id)
            if state is None:
                continue
            parent = state.parent
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            stop_str = state.add(out)
            finish_reason = out.finish_reason.value if out.finish_reason else None
            stop_reason = out.stop_reason
            if stop_str is not None and finish_reason is None:
                finish_reason, stop_reason = "stop", stop_str
                stopped.append(out.req_id)
            sp = parent.sampling_params
            if finish_reason is not None or sp.output_kind != "final":
                parent.completions[state.index] = state.completion(
                    finish_reason, stop_reason, delta=sp.output_kind == "delta", error=out.error
                )
            if finish_reason is not None:
                parent.num_finished += 1
                del self.states[out.req_id]
            touched[parent.request_id] = parent
        return [r for p in touched.values() if (r := self._make_output(p)) is not None], stopped

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish parents as aborted; returns their last outputs."""
        results = []
        for request_id in request_ids:
            parent = self.parents.get(request_id)
            if parent is None:
                continue
            for child_id in parent.children:
                state = self.states.pop(child_id, None)
                if state is not None:
                    parent.completions[state.index] = state.completion("abort", None, delta=False)
                    parent.num_finished += 1
            if (r := self._make_output(parent)) is not None:
                results.append(r)
        return results

    def _add_prompt_logprobs(self, parent: ParentRequest, chunk: PromptLogprobsChunk) -> None:
        # Positions already filled (by a sibling, or before a preemption) stay as they are.
        # As for sampled tokens, detokenize=False leaves decoded_token None (vLLM does).
        tokenizer = self.tokenizer if parent.sampling_params.detokenize else None
        for j, (ids, lps, rank) in enumerate(zip(chunk.token_ids, chunk.logprobs, chunk.ranks)):
            if parent.prompt_logprobs[chunk.start + j] is None:
                parent.prompt_logprobs[chunk.start + j] = logprob_entry(ids, lps, rank, tokenizer)

    def _make_output(self, parent: ParentRequest) -> RequestOutput | None:
        finished = parent.num_finished == len(parent.children)
        sp = parent.sampling_params
        if sp.output_kind == "final" and not finished:
            return None
        if finished:
            del self.parents[parent.request_id]
        completions = [parent.completions[i] for i in sorted(parent.completions)]
        if finished and len(completions) > sp.n:  # best_of > n
            completions = sorted(completions, key=lambda c: c.cumulative_logprob, reverse=True)[: sp.n]
            for index, completion in enumerate(completions):
                completion.index = index
                if sp.logprobs is None:
                    completion.cumulative_logprob = None
        if sp.output_kind == "delta":
            parent.completions = {}
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
        )


def logprob_entry(ids: list[int], lps: list[float], rank: int, tokenizer) -> dict[int, Logprob]:
    """vLLM's per-position dict: the chosen (or prompt) token with its rank, and the
    top-k tokens with ranks 1..k; a token in both keeps the chosen token's rank."""
    entry = {tid: Logprob(lp, rank=i) for i, (tid, lp) in enumerate(zip(ids, lps)) if i}
    entry[ids[0]] = Logprob(lps[0], rank=rank)
    if tokenizer is not None:
        for tid, lp in entry.items():
            lp.decoded_token = tokenizer.decode([tid])
    return entry
