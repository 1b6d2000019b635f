"""Decode speed and weight memory of the embedded SmolLM2 GGUF kept quantized
(``quantization="gguf"``) against its dense conversion, in the same run.

    .venv/bin/python benchmarks/gguf_decode.py                    # bfloat16, 2 threads, 64 tokens, 3 rounds
    .venv/bin/python benchmarks/gguf_decode.py --dtype float32 --rounds 1

Batch 1: one 8-token prompt, 64 greedy output tokens with ``ignore_eos``. Each round
runs every engine once, alternating, so that load from other processes hits both
alike; the best round of each is reported. Decode step time is
``(time for 64 tokens - time for 1 token) / 63``.
"""

from __future__ import annotations

import argparse
import time

from vframe import LLM, SamplingParams
from vframe.models.loader.load import quantized_linear_layers, weight_bytes

PROMPT = [1, 504, 3458, 282, 4649, 314, 9551, 30]  # 8 token ids


def generate_s(llm: LLM, max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    engines = {
        name: LLM(dtype=args.dtype, quantization=quantization, max_model_len=256, num_threads=args.threads)
        for name, quantization in (("dense", None), ("gguf", "gguf"))
    }
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            generate_s(llm, 4)  # warm-up
            first, total = generate_s(llm, 1), generate_s(llm, args.tokens)
            step = (total - first) / (args.tokens - 1)
            if name not in best or step < best[name][0]:
                best[name] = (step, first)

    print(f"dtype={args.dtype} threads={args.threads} batch 1, {args.tokens} output tokens, best of {args.rounds}")
    print("engine | weights MiB | quantized linears MiB | prefill + 1 token ms | decode step ms | decode tok/s")
    for name, llm in engines.items():
        model = llm.llm_engine.model_runner.model
        linears = sum(weight_bytes(m) for m in quantized_linear_layers(model))
        step, first = best[name]
        print(
            f"{name} | {weight_bytes(model) / 2**20:.1f} | {linears / 2**20:.1f} | {first * 1e3:.1f} | "
            f"{step * 1e3:.2f} | {1 / step:.1f}"
        )
    print(f"gguf / dense decode time: {best['gguf'][0] / best['dense'][0]:.2f}")


if __name__ == "__main__":
    main()
