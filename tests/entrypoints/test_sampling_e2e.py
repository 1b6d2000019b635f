"""Sampling parameters end to end on the real SmolLM2: penalties against transformers'
generate, seeds, best_of, truncation, bad words, logits processors, finish reasons."""

import copy

import pytest
import torch

from vframe import SamplingParams
from vframe.core.interfaces import LogitsProcessor
from vframe.errors import InvalidRequestError, PluginError
from vframe.plugins import hookimpl, register_plugin, unregister_plugin

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPT = "The capital of France is"


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def hf_generate(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        generation_config=config,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        **kwargs,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_greedy_with_repetition_penalty_matches_transformers(llm_fp32, hf_smollm, tokenizer, penalty):
    prompt = tokenizer("Numbers: 1, 2, 1, 2, 1, 2,").input_ids
    params = SamplingParams(max_tokens=12, repetition_penalty=penalty, **GREEDY)
    [out] = llm_fp32.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_generate(hf_smollm, prompt, 12, repetition_penalty=penalty)


def test_penalties_change_greedy_output_and_none_leaves_it(llm_fp32):
    base = SamplingParams(max_tokens=16, **GREEDY)
    penalized = SamplingParams(max_tokens=16, frequency_penalty=1.5, presence_penalty=1.0, **GREEDY)
    plain, with_penalty = llm_fp32.generate([PROMPT, PROMPT], [base, penalized], use_tqdm=False)
    [again] = llm_fp32.generate(PROMPT, base, use_tqdm=False)
    assert plain.outputs[0].token_ids == again.outputs[0].token_ids
    ids = with_penalty.outputs[0].token_ids
    assert ids != plain.outputs[0].token_ids
    assert len(set(ids)) == len(ids)  # presence 1.0 + frequency 1.5 on this prompt: no token repeats


def test_seeded_request_is_the_same_alone_and_in_a_mixed_batch(llm_fp32):
    seeded = SamplingParams(temperature=0.8, top_k=40, seed=99, max_tokens=12, ignore_eos=True, repetition_penalty=1.1)
    [alone] = llm_fp32.generate("My favourite food is", seeded, use_tqdm=False)
    others = [
        SamplingParams(max_tokens=12, **GREEDY),
        SamplingParams(temperature=1.2, top_p=0.9, max_tokens=12, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(temperature=0.7, seed=5, max_tokens=12, ignore_eos=True, logit_bias={11: 3.0}),
        SamplingParams(temperature=0.0, max_tokens=12, bad_words=["the"], ignore_eos=True),
    ]
    outs = llm_fp32.generate(
        ["Hello", "My favourite food is", "Once", "Numbers: 1, 2,", "Water is"],
        [others[0], seeded, others[1], others[2], others[3]],
        use_tqdm=False,
    )
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    other_seeds = [
        llm_fp32.generate("My favourite food is", SamplingParams(**{**vars_of(seeded), "seed": s}), use_tqdm=False)[0]
        for s in (1, 2)
    ]
    assert len({tuple(o.outputs[0].token_ids) for o in [alone, *other_seeds]}) == 3


def vars_of(sp: SamplingParams) -> dict:
    return {k: v for k, v in vars(sp).items() if not k.startswith("_")}


def test_seeded_sampling_with_penalties_survives_preemption(llm_fp32):
    from vframe import LLM

    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # float32 KV of one 16-token block
    prompts = ["The capital of France is", "Water boils at", "The three primary colours are", "In 1969,"]
    params = [
        SamplingParams(temperature=0.9, seed=i, max_tokens=20, ignore_eos=True, frequency_penalty=0.4)
        for i in range(len(prompts))
    ]
    expected = token_ids(llm_fp32.generate(prompts, params, use_tqdm=False))
    small = LLM(dtype="float32", max_model_len=64, kv_cache_memory_bytes=5 * block_bytes, num_threads=2)
    assert token_ids(small.generate(prompts, params, use_tqdm=False)) == expected
    assert small.get_stats()["num_preemptions"] > 0


def test_best_of_returns_the_n_most_likely_of_its_completions(llm_fp32):
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=0)
    [all4] = llm_fp32.generate(PROMPT, params, use_tqdm=False)
    ranked = sorted(all4.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    best = SamplingParams(n=2, best_of=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    [out] = llm_fp32.generate(PROMPT, best, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked[:2]]
    assert out.outputs[0].cumulative_logprob is None  # logprobs were not asked for


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm_fp32, tokenizer):
    ids = tokenizer("Some words before. The capital of France is").input_ids
    params = SamplingParams(max_tokens=5, truncate_prompt_tokens=6, **GREEDY)
    [cut] = llm_fp32.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    [ref] = llm_fp32.generate({"prompt_token_ids": ids[-6:]}, SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    assert cut.prompt_token_ids == ids[-6:]
    assert cut.outputs[0].token_ids == ref.outputs[0].token_ids


def test_bad_words_never_appear(llm_fp32):
    msg = [{"role": "user", "content": "What is the capital of France?"}]
    [free] = llm_fp32.chat(msg, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    assert "Paris" in free.outputs[0].text
    [banned] = llm_fp32.chat(msg, SamplingParams(temperature=0.0, max_tokens=20, bad_words=["Paris"]), use_tqdm=False)
    assert "Paris" not in banned.outputs[0].text


def test_logprobs_of_a_sampled_token_carry_its_rank(llm_fp32):
    params = SamplingParams(temperature=1.5, seed=0, max_tokens=12, logprobs=3, ignore_eos=True)
    [out] = llm_fp32.generate("Random words:", params, use_tqdm=False)
    comp = out.outputs[0]
    for token_id, step in zip(comp.token_ids, comp.logprobs):
        chosen = step[token_id]
        others = [lp for t, lp in step.items() if t != token_id]
        if chosen.rank <= 3:  # the chosen token is one of the top 3: three entries
            assert sorted(lp.rank for lp in step.values()) == [1, 2, 3]
        else:  # chosen first, then the top 3
            assert sorted(lp.rank for lp in others) == [1, 2, 3]
            assert chosen.logprob < min(lp.logprob for lp in others)
    assert any(step[t].rank > 1 for t, step in zip(comp.token_ids, comp.logprobs))  # it did sample


def test_finish_and_stop_reasons_follow_vllm(llm_fp32, tokenizer):
    msg = [{"role": "user", "content": "Say hi."}]
    [eos] = llm_fp32.chat(msg, SamplingParams(temperature=0.0, max_tokens=60), use_tqdm=False)
    assert (eos.outputs[0].finish_reason, eos.outputs[0].stop_reason) == ("stop", None)
    [length] = llm_fp32.generate(PROMPT, SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    assert (length.outputs[0].finish_reason, length.outputs[0].stop_reason) == ("length", None)
    first = length.outputs[0].token_ids[0]
    [tok] = llm_fp32.generate(PROMPT, SamplingParams(max_tokens=5, stop_token_ids=[first], **GREEDY), use_tqdm=False)
    assert (tok.outputs[0].finish_reason, tok.outputs[0].stop_reason) == ("stop", first)


# --------------------------------------------------------------------------- #
# logits processors
# --------------------------------------------------------------------------- #


def only(token_id: int):
    def force(output_ids, logits):
        out = torch.full_like(logits, float("-inf"))
        out[token_id] = 0.0
        return out

    return force


def test_callable_logits_processors_in_both_vllm_forms(llm_fp32, tokenizer):
    seen = []

    def with_prompt(prompt_ids, output_ids, logits):
        seen.append((len(prompt_ids), len(output_ids)))
        return logits

    comma = tokenizer.encode(",", add_special_tokens=False)[0]
    params = [
        SamplingParams(max_tokens=3, logits_processors=[only(comma)], **GREEDY),
        SamplingParams(max_tokens=3, logits_processors=[with_prompt], **GREEDY),
        SamplingParams(max_tokens=3, **GREEDY),
    ]
    forced, observed, plain = llm_fp32.generate([PROMPT] * 3, params, use_tqdm=False)
    assert forced.outputs[0].token_ids == [comma] * 3
    assert observed.outputs[0].token_ids == plain.outputs[0].token_ids
    n = len(tokenizer(PROMPT).input_ids)
    assert seen == [(n, 0), (n, 1), (n, 2)]


class BanToken(LogitsProcessor):
    """A registered processor with a constructor argument: never sample ``token_id``."""

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id

    def __call__(self, token_ids, logits):
        logits[self.token_id] = float("-inf")
        return logits


class Plugin:
    @hookimpl
    def vframe_register_logits_processors(self, register):
        register("ban_token", BanToken)


@pytest.fixture
def ban_plugin():
    register_plugin(Plugin(), "ban-token-test")
    yield
    unregister_plugin("ban-token-test")


def test_registered_logits_processor_by_name(llm_fp32, ban_plugin):
    [plain] = llm_fp32.generate(PROMPT, SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    first = plain.outputs[0].token_ids[0]
    params = SamplingParams(max_tokens=4, logits_processors=[("ban_token", {"token_id": first})], **GREEDY)
    [out] = llm_fp32.generate(PROMPT, params, use_tqdm=False)
    assert first not in out.outputs[0].token_ids
    with pytest.raises(PluginError, match="unknown logits processor 'nope'; known: ban_token"):
        llm_fp32.generate(PROMPT, SamplingParams(logits_processors=["nope"]), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="logits processor 'ban_token': bad arguments"):
        llm_fp32.generate(PROMPT, SamplingParams(logits_processors=[("ban_token", {"x": 1})]), use_tqdm=False)


def test_token_ids_out_of_the_vocabulary_are_rejected(llm_fp32):
    with pytest.raises(InvalidRequestError, match=r"allowed_token_ids has token ids out of range \[0, 49152\): \[50000\]"):
        llm_fp32.generate(PROMPT, SamplingParams(allowed_token_ids=[5, 50000]), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"logit_bias has token ids out of range"):
        llm_fp32.generate(PROMPT, SamplingParams(logit_bias={60000: 1.0}), use_tqdm=False)
