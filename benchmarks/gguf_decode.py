"""Decode speed, weight memory and peak RSS of the embedded SmolLM2 GGUF kept
quantized (``quantization="gguf"``) against its dense conversion, in the same run.

    .venv/bin/python benchmarks/gguf_decode.py                    # bfloat16, 2 threads, 64 tokens, 3 rounds
    .venv/bin/python benchmarks/gguf_decode.py --dtype float32 --rounds 1

Batch 1: one 8-token prompt, 64 greedy output tokens with ``ignore_eos``. Each round
runs every engine once, alternating, so that load from other processes hits both
alike; the best round of each is reported. Decode step time is
``(time for 64 tokens - time for 1 token) / 63``. The LM head alone: one
``compute_logits`` on 1 and on 64 hidden states. Peak RSS: each engine loaded
in a process of its own, which then generates 8 tokens
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``), beside a process that only
imports vframe and torch.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import time

import torch

from vframe import LLM, SamplingParams
from vframe.models.loader.load import quantized_linear_layers, weight_bytes

PROMPT = [1, 504, 3458, 282, 4649, 314, 9551, 30]  # 8 token ids
QUANTIZATIONS = (("dense", None), ("gguf", "gguf"))


def generate_s(llm: LLM, max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    return time.perf_counter() - start


def head_ms(llm: LLM, batch: int, repeats: int = 5) -> float:
    model = llm.llm_engine.model_runner.model
    hidden = torch.randn(batch, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(model.dtype)
    model.compute_logits(hidden)
    start = time.perf_counter()
    for _ in range(repeats):
        model.compute_logits(hidden)
    return (time.perf_counter() - start) / repeats * 1e3


def peak_rss_mib(dtype: str, quantization: str | None, threads: int, load: bool = True) -> float:
    """Peak resident memory of a process that loads one engine and generates 8 tokens (``load=False``: imports only)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_peak_rss_child, (dtype, quantization, threads, load))


def _peak_rss_child(dtype: str, quantization: str | None, threads: int, load: bool) -> float:
    if load:
        llm = LLM(dtype=dtype, quantization=quantization, max_model_len=256, num_threads=threads)
        generate_s(llm, 8)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    # Before this process grows: a child process starts with its parent's peak RSS (Linux keeps it across exec).
    rss = {name: peak_rss_mib(args.dtype, quantization, args.threads) for name, quantization in QUANTIZATIONS}
    rss_base = peak_rss_mib(args.dtype, None, args.threads, load=False)
    engines = {
        name: LLM(dtype=args.dtype, quantization=quantization, max_model_len=256, num_threads=args.threads)
        for name, quantization in QUANTIZATIONS
    }
    heads = {name: (head_ms(llm, 1), head_ms(llm, 64)) for name, llm in engines.items()}
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            generate_s(llm, 4)  # warm-up
            first, total = generate_s(llm, 1), generate_s(llm, args.tokens)
            step = (total - first) / (args.tokens - 1)
            if name not in best or step < best[name][0]:
                best[name] = (step, first)

    print(f"dtype={args.dtype} threads={args.threads} batch 1, {args.tokens} output tokens, best of {args.rounds}")
    print(
        "engine | weights MiB | quantized layers MiB | peak RSS MiB | prefill + 1 token ms | decode step ms | "
        "decode tok/s | LM head ms, 1 / 64 rows"
    )
    for name, llm in engines.items():
        model = llm.llm_engine.model_runner.model
        quantized = sum(weight_bytes(m) for m in quantized_linear_layers(model))
        step, first = best[name]
        print(
            f"{name} | {weight_bytes(model) / 2**20:.1f} | {quantized / 2**20:.1f} | {rss[name]:.0f} | "
            f"{first * 1e3:.1f} | {step * 1e3:.2f} | {1 / step:.1f} | {heads[name][0]:.1f} / {heads[name][1]:.1f}"
        )
    print(f"peak RSS of a process that imports vframe and torch only: {rss_base:.0f} MiB")
    print(f"gguf / dense decode time: {best['gguf'][0] / best['dense'][0]:.2f}")


if __name__ == "__main__":
    main()
