"""Beam search with transformers' semantics, run on the engine one step at a time.

Each step, every live beam of every prompt becomes a one-token request whose
prompt is the beam's prompt plus its tokens so far, asking for its ``2 * W``
most likely next tokens (``W`` = beam width). The beams of a prompt share all
but their last few tokens, so prefix caching (on by default) serves every full
KV block they have in common: a step recomputes at most ``block_size`` tokens
per beam, not the whole sequence.

The selection is transformers' ``generate(num_beams=W)`` (``_beam_search``):

* the ``2W`` best continuations over all beams, by cumulative logprob;
* those among the first ``W`` that end in EOS (or reach ``max_tokens``) join the
  finished set with score ``cum_logprob / generated_len ** length_penalty``
  (``generated_len`` counts the EOS); the set keeps its ``W`` best;
* the ``W`` best continuations that did not end become the next beams;
* ``early_stopping``: ``True`` stops once ``W`` beams finished; ``False`` once
  the best live beam, normalized at its current length, cannot beat the worst
  finished one; ``"never"`` uses the longest possible length when
  ``length_penalty > 0``.

vLLM differs (and vframe follows transformers): vLLM finishes every EOS
continuation, not only those ranked within ``W``; it normalizes by the whole
sequence length including the prompt and excluding the EOS; it has no early
stopping and keeps all finished beams until ``max_tokens``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from vframe.core.outputs import Logprob

# One engine step for many token prompts: per prompt, the next-token logprob dict.
StepFn = Callable[[list[list[int]], int], list[dict[int, Logprob]]]


@dataclass
class BeamSearchSequence:
    """One beam. ``tokens`` includes the prompt (as in vLLM)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class _Finished:
    score: float
    beam: BeamSearchSequence


class BeamSearchInstance:
    """The beam search of one prompt."""

    def __init__(
        self,
        prompt_token_ids: list[int],
        beam_width: int,
        max_tokens: int,
        eos_token_ids: set[int],
        length_penalty: float,
        early_stopping: bool | str,
    ) -> None:
        self.num_prompt_tokens = len(prompt_token_ids)
        self.beam_width = beam_width
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.beams = [BeamSearchSequence(tokens=list(prompt_token_ids))]
        self.finished: list[_Finished] = []  # at most beam_width, best first
        self.improvement_possible = True
        self.done = False

    def step(self, next_logprobs: list[dict[int, Logprob]]) -> None:
        """Advance by one token; ``next_logprobs[i]``: beam ``i``'s top next tokens."""
        w = self.beam_width
        candidates = sorted(
            (
                (beam.cum_logprob + lp.logprob, b, token_id)
                for b, (beam, lps) in enumerate(zip(self.beams, next_logprobs))
                for token_id, lp in lps.items()
            ),
            key=lambda c: c[0],
            reverse=True,
        )[: 2 * w]
        generated_len = len(self.beams[0].tokens) - self.num_prompt_tokens + 1
        at_max_len = generated_len >= self.max_tokens
        full = len(self.finished) == w and self.early_stopping is True
        live: list[BeamSearchSequence] = []
        for rank, (score, b, token_id) in enumerate(candidates):
            parent = self.beams[b]
            ends = token_id in self.eos_token_ids
            beam = BeamSearchSequence(
                tokens=parent.tokens + [token_id],
                logprobs=parent.logprobs + [next_logprobs[b]],
                cum_logprob=score,
            )
            if ends or at_max_len:
                beam.finish_reason = "stop" if ends else "length"
                if rank < w and self.improvement_possible and not full:
                    self.finished.append(_Finished(score / generated_len**self.length_penalty, beam))
            elif len(live) < w:
                live.append(beam)
        self.finished = sorted(self.finished, key=lambda f: f.score, reverse=True)[:w]
        self.beams = live
        self._check_done(generated_len)

    def _check_done(self, generated_len: int) -> None:
        w = self.beam_width
        if len(self.finished) == w and self.beams:
            length = generated_len
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                length = self.max_tokens
            best_possible = self.beams[0].cum_logprob / length**self.length_penalty
            self.improvement_possible &= best_possible > self.finished[-1].score
        all_finished = len(self.finished) == w and self.early_stopping is True
        self.done = not self.beams or not self.improvement_possible or all_finished

    def result(self) -> list[BeamSearchSequence]:
        """The best ``beam_width`` sequences; live beams fill in if fewer finished."""
        if len(self.finished) < self.beam_width:
            for beam in self.beams:
                beam.finish_reason = "length"
                length = len(beam.tokens) - self.num_prompt_tokens
                self.finished.append(_Finished(beam.cum_logprob / length**self.length_penalty, beam))
            self.finished.sort(key=lambda f: f.score, reverse=True)
        return [f.beam for f in self.finished[: self.beam_width]]


def beam_search(
    prompts: list[list[int]],
    beam_width: int,
    max_tokens: int,
    eos_token_ids: set[int],
    length_penalty: float,
    early_stopping: bool | str,
    step_fn: StepFn,
) -> list[list[BeamSearchSequence]]:
    """Run every prompt's beam search; each step sends all live beams of all
    prompts to ``step_fn`` at once."""
    instances = [
        BeamSearchInstance(p, beam_width, max_tokens, eos_token_ids, length_penalty, early_stopping)
        for p in prompts
    ]
    while active := [inst for inst in instances if not inst.done]:
        beams = [beam.tokens for inst in active for beam in inst.beams]
        next_logprobs = step_fn(beams, 2 * beam_width)
        ends = list(itertools.accumulate(len(inst.beams) for inst in active))
        for inst, start, end in zip(active, [0, *ends], ends):
            inst.step(next_logprobs[start:end])
    return [inst.result() for inst in instances]
