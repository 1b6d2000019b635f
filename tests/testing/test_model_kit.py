"""vframe.testing.models: the parity rule, vframe's Llama passing it on the
embedded SmolLM2, and a model with a faulty output head failing it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from vframe.models.llama import LlamaForCausalLM
from vframe.plugins import hookimpl, register_plugin, unregister_plugin
from vframe.testing.models import GreedyRun, assert_matches_transformers, first_divergence

BANANA = 21285  # " banana" in SmolLM2's vocabulary

# --------------------------------------------------------------------------- #
# The rule
# --------------------------------------------------------------------------- #

TOP = [[5, 6, 7, 8, 9], [1, 2, 3, 4, 9], [1, 2, 3, 4, 5]]


def test_equal_tokens_agree() -> None:
    assert first_divergence(GreedyRun([5, 1, 1], TOP), GreedyRun([5, 1, 1], TOP)) is None


def test_a_near_tie_ends_the_comparison() -> None:
    # step 1: vframe takes 2, transformers 1, each in the other's top 5; the
    # continuations then differ and are not compared
    ours = GreedyRun([5, 2, 4], [[5, 6, 7, 8, 9], [2, 1, 3, 4, 9], [4, 1, 2, 3, 5]])
    ref = GreedyRun([5, 1, 1], TOP)

    assert first_divergence(ours, ref) is None


def test_a_token_outside_the_other_sides_top5_fails() -> None:
    ours = GreedyRun([5, 9, 1], [[5, 6, 7, 8, 9], [9, 0, 10, 11, 12], [1, 2, 3, 4, 5]])
    ref = GreedyRun([5, 1, 1], TOP)

    assert first_divergence(ours, ref) == (
        "first different token at step 1: vframe 9, transformers 1; "
        "transformers' token 1 is not in vframe's top 5 [9, 0, 10, 11, 12]"
    )
    assert first_divergence(ref, ours) == (
        "first different token at step 1: vframe 1, transformers 9; "
        "vframe's token 1 is not in transformers' top 5 [9, 0, 10, 11, 12]"
    )


def test_a_short_generation_fails() -> None:
    assert first_divergence(GreedyRun([5, 1], TOP[:2]), GreedyRun([5, 1, 1], TOP)) == (
        "vframe generated 2 tokens, transformers 3"
    )


# --------------------------------------------------------------------------- #
# Real models
# --------------------------------------------------------------------------- #

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def test_embedded_smollm_matches_transformers(llm_fp32, hf_smollm, tokenizer) -> None:
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a fruit."}], add_generation_prompt=True, tokenize=False
    )
    chat_ids = tokenizer(chat, add_special_tokens=False).input_ids
    assert_matches_transformers(None, [*PROMPTS, chat_ids], max_tokens=8, llm=llm_fp32, hf_model=hf_smollm)


class FavoursBanana(LlamaForCausalLM):
    """A faulty output head: a bias of +30 on one token."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        logits[:, BANANA] += 30.0
        return logits


@pytest.fixture
def banana_model() -> Iterator[None]:
    class Plugin:
        @staticmethod
        @hookimpl
        def vframe_register_models(register) -> None:
            register("LlamaForCausalLM", FavoursBanana, override=True)

    register_plugin(Plugin, "test-banana-model")
    yield
    unregister_plugin("test-banana-model")


def test_a_faulty_model_fails_at_its_first_token(banana_model: None, hf_smollm) -> None:
    with pytest.raises(AssertionError) as failure:
        assert_matches_transformers(
            None, PROMPTS[:1], max_tokens=4, hf_model=hf_smollm, max_model_len=256, num_threads=2
        )

    message = str(failure.value)
    assert message.startswith(
        "prompt 0 ([504, 3575, 282, 4649, 314] 'The capital of France is', 5 tokens): first different token "
        f"at step 0: vframe {BANANA}, transformers 7042; vframe's token {BANANA} is not in transformers' top 5 "
        "[7042, "
    ), message
    assert "transformers' token" not in message  # 7042 is second in vframe's top 5: only the bias is wrong
    assert f"\n  vframe:       [{BANANA}, {BANANA}, {BANANA}, {BANANA}] ' banana banana banana banana'\n" in message
    assert message.splitlines()[2].startswith("  transformers: [7042, 30, ") # " Paris."
