"""One parity check for every model family: a tiny random checkpoint served by the
engine (batched prompts of different lengths, prefix caching, chunked prefill,
and a KV cache small enough to force preemption) against transformers.

Greedy tokens must be equal to transformers' ``generate``, and each chosen
token's logprob within ``LOGPROB_ATOL`` of the logprob transformers computes for
it in one forward pass over prompt + continuation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

LOGPROB_ATOL = 1e-3


def prompts_of_lengths(vocab_size: int, lengths: list[int], shared_prefix: int = 0, seed: int = 1) -> list[list[int]]:
    """Random token-id prompts; the first ``shared_prefix`` ids are the same in
    every prompt (so that the prefix cache has something to hit)."""
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, vocab_size, (shared_prefix,), generator=generator).tolist()
    return [prefix + torch.randint(1, vocab_size, (n - shared_prefix,), generator=generator).tolist() for n in lengths]


def transformers_greedy(hf_model: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation (EOS ignored) and each token's logprob."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = hf_model.generate(
            ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )
        tokens = out[0, len(prompt):].tolist()
        logits = hf_model(out).logits[0, len(prompt) - 1 : -1].float()  # [max_tokens, V]
        logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return tokens, logprobs.tolist()


def engine_kwargs_for_stress(num_blocks: int) -> dict[str, Any]:
    """Prefix caching on, chunks of 16 tokens, ``num_blocks`` blocks of 4 tokens."""
    return dict(
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        block_size=4,
        num_gpu_blocks_override=num_blocks,
        skip_tokenizer_init=True,
    )


def assert_engine_matches_transformers(
    model_dir: Path,
    hf_model: Any,
    prompts: list[list[int]],
    *,
    max_tokens: int = 8,
    num_blocks: int = 24,
    dtype: str = "float32",
    expect_stress: bool = True,
    **llm_kwargs: Any,
) -> Any:
    """Run ``prompts`` through ``LLM(model_dir)`` in one batch and compare every
    prompt with transformers; with ``expect_stress`` (the default) also assert
    that the run did preempt and did hit the prefix cache, so that the check
    covers them. Returns the ``LLM``."""
    from vframe import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, **(engine_kwargs_for_stress(num_blocks) | llm_kwargs))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    hf_model = hf_model.float() if dtype == "float32" else hf_model
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        completion = output.outputs[0]
        ref_tokens, ref_logprobs = transformers_greedy(hf_model, prompt, max_tokens)
        assert completion.token_ids == ref_tokens, f"prompt {i} (len {len(prompt)}): {completion.token_ids} != {ref_tokens}"
        ours = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
        torch.testing.assert_close(
            torch.tensor(ours), torch.tensor(ref_logprobs), rtol=0, atol=LOGPROB_ATOL,
            msg=lambda m, i=i: f"prompt {i}: chosen-token logprobs differ: {m}",
        )
    if expect_stress:
        stats = llm.llm_engine.get_stats()
        assert stats["num_preemptions"] >= 1, f"no preemption happened (num_blocks={num_blocks} too many?): {stats}"
        assert stats["prefix_cache_hits"] > 0, f"no prefix cache hit: {stats}"
    return llm
