"""prompt_logprobs against transformers' log-softmax over the prompt, real SmolLM2 weights."""

import pytest
import torch

from vframe import LLM, SamplingParams

PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is",
    "Photosynthesis is the process by which plants " * 6,  # ~60 tokens: several KV blocks
    "def add(a, b):\n    return a + b",
]
K = 3


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(p).input_ids for p in PROMPTS]


def hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()  # [L, V]
    return torch.log_softmax(logits, dim=-1)


def check(out, ref: torch.Tensor, ids: list[int]) -> None:
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry, row = out.prompt_logprobs[pos], ref[pos - 1]
        token = ids[pos]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=2e-3)
        ref_rank = int((row > row[token]).sum()) + 1
        assert abs(entry[token].rank - ref_rank) <= max(1, ref_rank // 50)  # float noise among near-ties
        top = sorted((lp for t, lp in entry.items() if lp.rank <= K and (t != token or ref_rank <= K)), key=lambda lp: lp.rank)
        assert [lp.logprob for lp in top] == pytest.approx(row.topk(K).values.tolist(), abs=2e-3)


def test_prompt_logprobs_match_transformers(llm_fp32, hf_smollm, prompt_ids):
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=K)
    # Generated before: their blocks sit in the prefix cache and must not hide any position.
    llm_fp32.generate([{"prompt_token_ids": ids} for ids in prompt_ids], SamplingParams(max_tokens=1), use_tqdm=False)
    outs = llm_fp32.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    for out, ids in zip(outs, prompt_ids):
        check(out, hf_prompt_logprobs(hf_smollm, ids), ids)
        assert out.prompt_logprobs[1][ids[1]].decoded_token is not None


def test_prompt_logprobs_with_chunked_prefill_and_n(hf_smollm, prompt_ids):
    llm = LLM(dtype="float32", max_model_len=256, max_num_batched_tokens=16, num_threads=2)
    ids = prompt_ids[1]
    params = SamplingParams(temperature=1.0, n=2, seed=0, max_tokens=2, prompt_logprobs=K)
    [out] = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    check(out, hf_prompt_logprobs(hf_smollm, ids), ids)
    assert len(out.outputs) == 2


def test_requests_without_prompt_logprobs_get_none(llm_fp32):
    [out] = llm_fp32.generate("Hello there", SamplingParams(max_tokens=1), use_tqdm=False)
    assert out.prompt_logprobs is None


def test_detokenize_false_leaves_every_decoded_token_none(llm_fp32):
    params = SamplingParams(max_tokens=2, temperature=0, logprobs=1, prompt_logprobs=1, detokenize=False)
    out = llm_fp32.generate("The capital of France is", params, use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None
    prompt_entries = [lp for position in out.prompt_logprobs[1:] for lp in position.values()]
    sampled_entries = [lp for position in out.outputs[0].logprobs for lp in position.values()]
    assert len(prompt_entries) >= 4 and len(sampled_entries) >= 2
    assert {lp.decoded_token for lp in prompt_entries + sampled_entries} == {None}
    # ... and detokenize=True fills them, prompt and sampled alike
    detokenized = SamplingParams(max_tokens=2, temperature=0, logprobs=1, prompt_logprobs=1)
    out = llm_fp32.generate("The capital of France is", detokenized, use_tqdm=False)[0]
    assert out.prompt_logprobs[1][out.prompt_token_ids[1]].decoded_token == " capital"
