"""Model parity against transformers: ``assert_matches_transformers``.

The rule (vLLM's): run both greedy for ``max_tokens`` tokens, ignoring EOS.
Tokens must be equal. Where the first differing token appears, each side's
token must be among the other side's five most likely tokens at that step (a
near tie that rounding may flip), and the comparison stops there: after a
different token the two continue from different texts. A token outside the
other's top 5 is a bug in the model, its weight loading or the engine.

In float32 a near tie is rare, and a flip in the first few tokens is worth a
look even when the rule accepts it; in bfloat16 flips are expected.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vframe import LLM

TOP_K = 5


@dataclass(frozen=True)
class GreedyRun:
    """One prompt's greedy continuation and, per step, the ``TOP_K`` most likely ids."""

    token_ids: list[int]
    top: list[list[int]]  # [step][rank], most likely first


def first_divergence(ours: GreedyRun, ref: GreedyRun) -> str | None:
    """``None`` when ``ours`` agrees with ``ref`` under the parity rule, else why not."""
    if len(ours.token_ids) != len(ref.token_ids):
        return f"vframe generated {len(ours.token_ids)} tokens, transformers {len(ref.token_ids)}"
    for step, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids)):
        if a == b:
            continue
        missing = []
        if a not in ref.top[step]:
            missing.append(f"vframe's token {a} is not in transformers' top {TOP_K} {ref.top[step]}")
        if b not in ours.top[step]:
            missing.append(f"transformers' token {b} is not in vframe's top {TOP_K} {ours.top[step]}")
        if not missing:
            return None  # a near tie: the texts differ from here on, nothing more to compare
        return f"first different token at step {step}: vframe {a}, transformers {b}; " + "; ".join(missing)
    return None


def assert_matches_transformers(
    model: str | os.PathLike[str] | None,
    prompts: list[str] | list[list[int]],
    *,
    max_tokens: int = 16,
    dtype: str = "float32",
    hf_model: Any = None,
    llm: LLM | None = None,
    **llm_kwargs: Any,
) -> None:
    """Generate greedily with vframe and with transformers' ``AutoModelForCausalLM``
    from the same checkpoint and apply the parity rule to every prompt; raise
    ``AssertionError`` at the first prompt that breaks it, with both sides'
    tokens (ids and text) up to the divergence.

    ``model``: a Hugging Face directory or a ``.gguf`` file (transformers reads
    the GGUF itself), ``None`` for the embedded SmolLM2. ``prompts``: strings,
    tokenized by the engine, or token ids. ``hf_model`` / ``llm``: already
    loaded models to reuse (``llm`` replaces ``dtype`` and ``llm_kwargs``);
    transformers runs in the engine's dtype, on its device.
    """
    if llm is None:
        from vframe import LLM

        llm = LLM(None if model is None else str(model), dtype=dtype, **llm_kwargs)
    engine = llm.llm_engine
    context = engine.plugin_context
    if hf_model is None:
        hf_model = load_transformers_model(model, context.dtype)
    hf_model = hf_model.to(context.device)
    prompt_ids = [list(p) if isinstance(p, list) else engine.tokenize_prompt(p)[1] for p in prompts]
    ours = _vframe_greedy(llm, prompt_ids, max_tokens)
    tokenizer = context.tokenizer
    for k, (ids, run) in enumerate(zip(prompt_ids, ours, strict=True)):
        ref = _transformers_greedy(hf_model, ids, max_tokens, context.device)
        why = first_divergence(run, ref)
        if why is not None:
            raise AssertionError(
                f"prompt {k} ({_show(tokenizer, ids[-12:])}, {len(ids)} tokens): {why}\n"
                f"  vframe:       {_show(tokenizer, run.token_ids)}\n"
                f"  transformers: {_show(tokenizer, ref.token_ids)}"
            )


def load_transformers_model(model: str | os.PathLike[str] | None, dtype: torch.dtype) -> Any:
    """transformers' own reading of ``model`` (a directory, or a GGUF file, which it
    dequantizes itself: not vframe's conversion of it)."""
    from transformers import AutoModelForCausalLM

    from vframe.models.loader import resolve_model

    resolved = resolve_model(model)
    if resolved.gguf_file is not None:
        gguf = resolved.gguf_file
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(resolved.model_dir), dtype=dtype, local_files_only=True)
    return hf.eval()


def _vframe_greedy(llm: LLM, prompt_ids: list[list[int]], max_tokens: int) -> list[GreedyRun]:
    from vframe import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    runs = []
    for out in outputs:
        completion = out.outputs[0]
        # the chosen token is the most likely, so each step's dict holds exactly the top TOP_K
        top = [[t for t, _ in sorted(step.items(), key=lambda kv: kv[1].rank)][:TOP_K] for step in completion.logprobs]
        runs.append(GreedyRun(list(completion.token_ids), top))
    return runs


def _transformers_greedy(hf_model: Any, prompt: list[int], max_tokens: int, device: torch.device) -> GreedyRun:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=max_tokens,
            do_sample=False,
            num_beams=1,
            repetition_penalty=1.0,
            # as keywords: a generation_config field set to None is refilled from the model's
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    top = [step[0].float().topk(TOP_K).indices.tolist() for step in out.logits]  # raw logits: before processors
    return GreedyRun(tokens, top)


def _show(tokenizer: Any, ids: list[int]) -> str:
    if tokenizer is None:
        return str(ids)
    return f"{ids} {tokenizer.decode(ids)!r}"
