"""vframe against transformers on the real SmolLM2-135M-Instruct weights, float32.

Greedy tokens over 24 steps must equal transformers' ``generate``; the chosen
token's logprob must be within 1e-2. If a token differs (float noise can flip a
near-tie), each side's token must be in the other's top-5 at that position and
the comparison stops there (vLLM's rule)."""

import copy

import pytest
import torch

from vframe import SamplingParams

NUM_STEPS = 24
PLAIN = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Photosynthesis is the process by which plants " * 12,  # ~100 tokens
    "Hi",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "An apple."},
        {"role": "user", "content": "Name another one, and say what colour it is."},
    ],
]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    plain = [tokenizer(p).input_ids for p in PLAIN]
    chats = [
        tokenizer(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
        for c in CHATS
    ]
    return plain + chats


def hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None  # compare a fixed number of steps, as ignore_eos does
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        generation_config=config,
        max_new_tokens=NUM_STEPS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1) for step in out.logits]


def test_greedy_tokens_and_logprobs_match_transformers(llm_fp32, hf_smollm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True, logprobs=5)
    outputs = llm_fp32.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    num_exact = 0
    for prompt, out in zip(prompts, outputs):
        ours = out.outputs[0]
        assert len(ours.token_ids) == NUM_STEPS
        ref_tokens, ref_logprobs = hf_greedy(hf_smollm, prompt)
        for i, (a, b) in enumerate(zip(ours.token_ids, ref_tokens)):
            ours_top5 = set(ours.logprobs[i])
            ref_top5 = set(ref_logprobs[i].topk(5).indices.tolist())
            if a != b:
                assert a in ref_top5 and b in ours_top5, (prompt, i, a, b)
                break
            assert ours.logprobs[i][a].logprob == pytest.approx(ref_logprobs[i][a].item(), abs=1e-2)
            assert ours.logprobs[i][a].rank == 1
        else:
            num_exact += 1
    # Float noise may flip a near-tie somewhere, but not in most prompts.
    assert num_exact >= len(prompts) - 1


def test_chat_answers_the_capital_question(llm_fp32):
    out = llm_fp32.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=32),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on <|im_end|>, not the cap
