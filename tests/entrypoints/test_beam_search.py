"""Beam search on the real SmolLM2 equals transformers' generate(num_beams=...) token for token."""

import copy

import pytest
import torch

from vframe import LLM, SamplingParams
from vframe.core.sampling_params import BeamSearchParams

PROMPTS = ["The capital of France is", "Once upon a time,", "def fibonacci(n):"]
MAX_TOKENS = 10


def hf_beams(model, prompt, width, length_penalty, early_stopping, max_tokens=MAX_TOKENS):
    config = copy.deepcopy(model.generation_config)
    config.update(
        num_beams=width, num_return_sequences=width, length_penalty=length_penalty,
        early_stopping=early_stopping, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
    )
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), generation_config=config
    )
    return [row[len(prompt) :].tolist() for row in out]


@pytest.mark.parametrize(
    ("width", "length_penalty", "early_stopping"),
    [(2, 1.0, False), (3, 0.0, "never"), (4, 2.0, True)],
)
def test_beam_search_matches_transformers(llm_fp32, hf_smollm, tokenizer, width, length_penalty, early_stopping):
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    params = BeamSearchParams(
        beam_width=width, max_tokens=MAX_TOKENS, length_penalty=length_penalty, early_stopping=early_stopping
    )
    outputs = llm_fp32.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs):
        ref = hf_beams(hf_smollm, prompt, width, length_penalty, early_stopping)
        assert len(out.sequences) == width
        for seq, ref_tokens in zip(out.sequences, ref):
            assert seq.tokens[: len(prompt)] == prompt  # vLLM: tokens include the prompt
            generated = seq.tokens[len(prompt) :]
            assert generated == ref_tokens[: len(generated)]
            assert all(t == 0 for t in ref_tokens[len(generated) :])  # transformers pads shorter beams
            assert seq.text == tokenizer.decode(seq.tokens)
        scores = [s.cum_logprob / (len(s.tokens) - len(prompt)) ** length_penalty for s in out.sequences]
        assert scores == sorted(scores, reverse=True)


def test_eos_ends_beams_and_ignore_eos_keeps_them(llm_fp32, hf_smollm, tokenizer):
    chat = [{"role": "user", "content": "What is 2 + 2? Answer with a number only."}]
    prompt = tokenizer(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
    [out] = llm_fp32.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=2, max_tokens=24))
    ref = hf_beams(hf_smollm, prompt, 2, 1.0, False, max_tokens=24)
    for seq, ref_tokens in zip(out.sequences, ref):
        assert seq.tokens[len(prompt) :] == ref_tokens[: len(seq.tokens) - len(prompt)]
    best = out.sequences[0]
    assert best.finish_reason == "stop" and best.tokens[-1] == tokenizer.eos_token_id
    [kept] = llm_fp32.beam_search(
        {"prompt_token_ids": prompt}, BeamSearchParams(beam_width=2, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    # The best beam answers, emits EOS and goes on past it.
    assert all(len(s.tokens) == len(prompt) + MAX_TOKENS and s.finish_reason == "length" for s in kept.sequences)
    assert tokenizer.eos_token_id in kept.sequences[0].tokens[len(prompt) : -1]


def test_use_beam_search_through_sampling_params(llm_fp32, tokenizer):
    params = SamplingParams(
        use_beam_search=True, n=2, best_of=3, temperature=0.0, max_tokens=MAX_TOKENS, length_penalty=0.5, ignore_eos=True
    )
    plain = SamplingParams(temperature=0.0, max_tokens=3)
    out, other = llm_fp32.generate([PROMPTS[0], PROMPTS[1]], [params, plain], use_tqdm=False)
    [ref] = llm_fp32.beam_search(
        PROMPTS[0], BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, length_penalty=0.5, ignore_eos=True)
    )
    prompt_len = len(out.prompt_token_ids)
    assert [c.token_ids for c in out.outputs] == [s.tokens[prompt_len:] for s in ref.sequences[:2]]
    assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert [c.index for c in out.outputs] == [0, 1] and out.finished
    assert len(other.outputs[0].token_ids) == 3


def test_beams_share_prefix_blocks(tokenizer):
    llm = LLM(dtype="float32", max_model_len=256, num_threads=2)
    prompt = tokenizer("Photosynthesis is the process by which plants " * 5).input_ids
    full_blocks = len(prompt) // 16
    assert full_blocks == 2
    llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=3, max_tokens=4))
    # 1 + 3 + 3 + 3 one-token requests; all but the first find the prompt's full blocks cached.
    assert llm.get_stats()["prefix_cache_hits"] >= 9 * full_blocks * 16
