"""``vframe bench shared-prefix``: prefix caching on against off, same run.

Workload (../shared/BENCHMARK.md): 64 requests sharing one 1,024-token prefix
(random non-special ids, ``numpy.random.default_rng(1)``) plus 32-128 unique
tokens each, 32 greedy output tokens with ``ignore_eos``, all submitted at once.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np


def shared_prefix_prompts(
    vocab_size: int, special_ids: set[int], num_requests: int = 64, prefix_len: int = 1024, seed: int = 1
) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    allowed = np.array([i for i in range(vocab_size) if i not in special_ids])
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist()
    suffix_lens = rng.integers(32, 129, size=num_requests)
    return [prefix + allowed[rng.integers(0, len(allowed), size=n)].tolist() for n in suffix_lens]


def add_shared_prefix_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: embedded)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (BENCHMARK.md: 2)")


def _run(args: argparse.Namespace, engine_kwargs: dict[str, Any], caching: bool) -> tuple[float, int, int]:
    import torch

    from vframe import LLM, SamplingParams
    from vframe.core.worker.model_runner import default_dtype_name

    torch.set_num_threads(args.threads)
    dtype = default_dtype_name(engine_kwargs.get("device") or "auto")
    llm = LLM(model=args.model, **{"dtype": dtype, **engine_kwargs, "enable_prefix_caching": caching})
    engine = llm.llm_engine
    prompts = shared_prefix_prompts(
        engine.vocab_size, set(engine.tokenizer.all_special_ids), args.num_prompts, args.prefix_len
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": list(range(100, 164))}], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    hits = int(llm.get_stats()["prefix_cache_hits"])
    return wall, sum(len(o.outputs[0].token_ids) for o in outputs), hits


def run_shared_prefix(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    results = {}
    for caching in (True, False):
        wall, out_tokens, hits = _run(args, engine_kwargs, caching)
        results[caching] = out_tokens / wall
        print(
            f"prefix caching {'on ' if caching else 'off'}: {out_tokens} output tokens in {wall:.1f} s | "
            f"output {out_tokens / wall:.1f} tok/s | prefix-cache hits {hits} tokens"
        )
    print(f"on / off output tokens/s: {results[True] / results[False]:.2f}x")
    return 0
