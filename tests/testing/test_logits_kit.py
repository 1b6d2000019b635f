"""vframe.testing.logits: well-behaved processors pass, each kind of misbehaviour fails."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from vframe.core.interfaces import LogitsProcessor
from vframe.core.plugin_context import PluginContext
from vframe.errors import InvalidRequestError
from vframe.plugins import hookimpl, register_plugin, unregister_plugin
from vframe.testing.logits import check_logits_processor


class BanLastToken(LogitsProcessor):
    """No immediate repeats: the last generated token gets -inf."""

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if token_ids:
            logits[token_ids[-1]] = float("-inf")
        return logits


class PenalizePromptTokens(LogitsProcessor):
    """vLLM's three-argument form: sees the prompt too; keeps per-request state."""

    def __init__(self, penalty: float = 1.0) -> None:
        self.penalty = penalty
        self.calls = 0

    def __call__(self, prompt_token_ids: list[int], token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return logits.index_add(0, torch.tensor(prompt_token_ids), torch.full((len(prompt_token_ids),), -self.penalty))


class BanEndOfSequence(LogitsProcessor):
    """Needs the engine's context: which ids end a sequence."""

    def __init__(self, context: PluginContext) -> None:
        self.eos = sorted(context.eos_token_ids)
        self.vocab_size = context.vocab_size

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape == (self.vocab_size,)
        logits[self.eos] = float("-inf")
        return logits


def test_well_behaved_processors_pass() -> None:
    check_logits_processor(BanLastToken)
    check_logits_processor(PenalizePromptTokens, kwargs={"penalty": 2.5}, vocab_size=1000)


def test_processor_with_context_gets_the_engines_context(llm_fp32) -> None:
    context = llm_fp32.llm_engine.plugin_context
    assert context.vocab_size == 49152 and context.eos_token_ids == frozenset({2})

    check_logits_processor(BanEndOfSequence, context=context)


@pytest.fixture
def registered() -> Iterator[None]:
    class Plugin:
        @staticmethod
        @hookimpl
        def vframe_register_logits_processors(register) -> None:
            register("test-ban-last", BanLastToken)
            register("test-penalize-prompt", PenalizePromptTokens)

    register_plugin(Plugin, "test-logits-kit")
    yield
    unregister_plugin("test-logits-kit")


def test_registered_names_are_built_the_engines_way(registered: None) -> None:
    check_logits_processor("test-ban-last")
    check_logits_processor("test-penalize-prompt", kwargs={"penalty": 0.5})
    with pytest.raises(InvalidRequestError, match=r"'test-penalize-prompt': bad arguments \{'alpha': 1\}"):
        check_logits_processor("test-penalize-prompt", kwargs={"alpha": 1})


class IntroducesNaN(LogitsProcessor):
    def __call__(self, token_ids, logits):
        return logits * torch.where(torch.arange(logits.shape[0]) == 7, float("nan"), 1.0)


class SetsPlusInf(LogitsProcessor):
    def __call__(self, token_ids, logits):
        logits[3] = float("inf")
        return logits


class MasksEverything(LogitsProcessor):
    def __call__(self, token_ids, logits):
        return torch.full_like(logits, float("-inf"))


class ReturnsBFloat16(LogitsProcessor):
    def __call__(self, token_ids, logits):
        return logits.bfloat16()


class ReturnsABatch(LogitsProcessor):
    def __call__(self, token_ids, logits):
        return logits[None, :]


class ReturnsAList(LogitsProcessor):
    def __call__(self, token_ids, logits):
        return logits.tolist()


class Unseeded(LogitsProcessor):
    def __call__(self, token_ids, logits):
        return logits + torch.rand(logits.shape)


class NeedsAHistory(LogitsProcessor):
    def __call__(self, token_ids, logits):
        logits[token_ids[-1]] -= 1.0
        return logits


@pytest.mark.parametrize(
    ("processor", "message"),
    [
        (IntroducesNaN, r"IntroducesNaN, step 0 \(generated so far: \[\]\): introduced NaN at token ids \[7\]"),
        (SetsPlusInf, r"step 0 .*: set \+inf at token ids \[3\] \(softmax would be NaN\)"),
        (MasksEverything, r"step 0 .*: masked every token with -inf"),
        (ReturnsBFloat16, r"step 0 .*: returned \(256,\) torch.bfloat16 on cpu, expected \(256,\) torch.float32"),
        (ReturnsABatch, r"step 0 .*: returned \(1, 256\) torch.float32 on cpu, expected \(256,\)"),
        (ReturnsAList, r"step 0 .*: returned list, not a tensor"),
        (Unseeded, r"Unseeded: not deterministic: at step 0 two fresh instances given equal token ids"),
        (NeedsAHistory, r"NeedsAHistory, step 0 \(generated so far: \[\]\): raised IndexError: list index"),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else "",
)
def test_misbehaving_processors_fail(processor: type, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_logits_processor(processor)


def test_history_grows_one_token_per_step() -> None:
    seen: list[list[int]] = []

    class Records(LogitsProcessor):
        def __call__(self, token_ids, logits):
            seen.append(list(token_ids))
            return logits

    check_logits_processor(Records, vocab_size=50)

    first_run = seen[: len(seen) // 2]
    assert seen[len(seen) // 2 :] == first_run  # the second instance sees the same generation
    assert [len(h) for h in first_run] == [0, 1, 2, 3, 4, 5]
    assert all(h[:-1] == prev for prev, h in zip(first_run, first_run[1:]))
    assert first_run[4][3] == first_run[4][2]  # a repeated token
    assert all(0 <= t < 50 for t in first_run[-1])
