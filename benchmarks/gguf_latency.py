"""Batch-1 latency and memory of GGUF files kept quantized (``quantization="gguf"``), each
on its default kernels and with its 5- and 6-bit types held in 8 bits
(``quant_kernel="int8_pairs"``), against the embedded SmolLM2 in bfloat16, taking turns.

    .venv/bin/python benchmarks/gguf_latency.py FILE.gguf [FILE.gguf ...] [--rounds 3]

The files used in docs/benchmarks.md are SmolLM2 quantized by llama.cpp: its dense directory
converted by llama.cpp's converter (``make test-quant`` installs it in ``.venv-quant``), then
``llama_model_quantize`` from ``llama-cpp-python``::

    .venv-quant/bin/python .venv-quant/llama.cpp/convert_hf_to_gguf.py DENSE_DIR --outtype f32 \\
        --outfile smol-f32.gguf
    PEER_PYTHON -c "import ctypes, llama_cpp as l; p = l.llama_model_quantize_default_params(); \\
        p.ftype = l.LLAMA_FTYPE_MOSTLY_Q4_K_M; l.llama_model_quantize(b'smol-f32.gguf', b'smol-q4_k_m.gguf', \\
        ctypes.byref(p))"

(``LLAMA_FTYPE_MOSTLY_Q5_K_M``, ``_Q6_K``, ``_IQ4_NL``, ``_IQ4_XS`` for the other files.)

The workload is ``vframe bench latency``'s (../shared/BENCHMARK.md: 256 prompt tokens, 128
greedy output tokens, 2 threads); per engine: its decoder layers' bytes and the median TPOT
over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from vframe import LLM, SamplingParams
from vframe.models.loader.load import weight_bytes


def tpot_ms(llm: LLM, prompt: dict, output_len: int) -> float:
    """One timed run after a warm-up prefill: (total - time to the first token) / the other tokens."""
    first = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prompt], first, use_tqdm=False)
    start = time.perf_counter()
    llm.generate([prompt], first, use_tqdm=False)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return (time.perf_counter() - start - ttft) / (output_len - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    common = dict(dtype="bfloat16", num_threads=args.threads, max_model_len=1024, kv_cache_memory_bytes=256 << 20)
    engines = {"bf16": LLM(**common)}
    for path in args.files:
        engines[f"{path.name}"] = LLM(model=str(path), quantization="gguf", **common)
        engines[f"{path.name} 8 bit"] = LLM(model=str(path), quantization="gguf", quant_kernel="int8_pairs", **common)
    prompt = {"prompt_token_ids": list(range(100, 100 + args.input_len))}
    for name, llm in engines.items():
        layers = llm.llm_engine.model_runner.model.model.layers
        print(f"{name:>28}: decoder layers {sum(weight_bytes(layer) for layer in layers) / 2**20:.1f} MiB", flush=True)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, llm in engines.items():
            times[name].append(tpot_ms(llm, prompt, args.output_len))
        print(f"round {r + 1}: " + "  ".join(f"{n} {t[-1]:.2f}" for n, t in times.items()), flush=True)
    for name, t in times.items():
        print(f"{name:>28}: TPOT median {statistics.median(t):.2f} ms (best {min(t):.2f})")


if __name__ == "__main__":
    main()
