"""Batch-1 latency of SmolLM2 quantized checkpoints against the same model in
bfloat16, and the embedded Q4_1 GGUF against llama.cpp, in one run (issue 13's
speed targets: int8 TPOT <= 0.7x bfloat16's, int4 <= 0.5x, GGUF Q4_1 <= llama.cpp's).

    .venv/bin/python benchmarks/quant_latency.py                       # every variant found
    .venv/bin/python benchmarks/quant_latency.py --llama-cpp-python /work/llama-venv/bin/python

The latency workload of ``vframe bench latency`` (../shared/BENCHMARK.md: one request,
256 prompt tokens, 128 greedy output tokens with ``ignore_eos``, best of 3 after a
warm-up, 2 threads) on each variant, one after another in this process:

- ``bf16``: the embedded SmolLM2 (its dense conversion) in bfloat16 (``--dtype float32``:
  ``float32``, and every variant in float32, for CPUs without native bfloat16);
- the llm-compressor / auto-round checkpoints that ``make test-quant`` caches in
  ``$VFRAME_CACHE_DIR/quant-checkpoints`` (W8A16 and W4A16 groups of 64, W8A8, GPTQ
  and AWQ 4 bit groups of 64, NVFP4A16, MXFP4A16), bfloat16 activations; the kernel each layer got is shown;
- ``gguf-q4_1``: the embedded GGUF kept quantized (``quantization="gguf"``), float
  activations (``woq_cpu``: exact against its dense conversion);
- ``gguf-q4_1-a8``: the same with ``quant_kernel="woq_cpu_a8"``: activations quantized to
  int8 per block of 32 for integer dot products, llama.cpp's own numerics;
- ``llama.cpp``: the same GGUF through ``llama-cpp-python`` in ``--llama-cpp-python``
  (its own environment; ``benchmarks/llama_cpp_peer.py``), fed the same prompt ids.

The ratio column is TPOT / the dense model's TPOT (and, for the GGUF, also / llama.cpp's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from vframe.bench.latency import _offline_args, run_vframe
from vframe.bench.throughput import model_workload_prompts
from vframe.models.loader.resolve import default_cache_dir, embedded_default_gguf

CHECKPOINTS = ("ct-w8a16", "ct-w8a8", "ct-w4a16", "ct-nvfp4a16", "ct-mxfp4a16", "autoround-gptq", "autoround-awq")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp-python", default=None, help="a Python with llama-cpp-python")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16",
                        help="vframe's dtype for every variant (float32 on CPUs without native bfloat16)")
    parser.add_argument("--only", default=None, help="comma-separated variant names")
    args = parser.parse_args()
    args.model = None
    cache = default_cache_dir() / "quant-checkpoints"
    base = "bf16" if args.dtype == "bfloat16" else args.dtype
    variants: list[tuple[str, str | None, dict]] = [(base, None, {})]
    variants += [(name, str(cache / name), {}) for name in CHECKPOINTS if (cache / name).exists()]
    variants.append(("gguf-q4_1", None, {"quantization": "gguf"}))
    variants.append(("gguf-q4_1-a8", None, {"quantization": "gguf", "quant_kernel": "woq_cpu_a8"}))
    if args.only:
        keep = set(args.only.split(","))
        variants = [v for v in variants if v[0] in keep or v[0] == base]

    results = {}
    for name, model, extra in variants:
        args.model = model
        result = run_vframe(args, {"dtype": args.dtype, "num_threads": args.threads, **extra})
        results[name] = result
        print(f"{name:>15}: TTFT {result.ttft_ms:7.1f} ms  TPOT {result.tpot_ms:6.2f} ms  "
              f"x {base} {result.tpot_ms / results[base].tpot_ms:.2f}", flush=True)

    if args.llama_cpp_python:
        args.model = None
        [prompt] = model_workload_prompts(_offline_args(args))
        with tempfile.TemporaryDirectory() as tmp:
            spec, out = Path(tmp) / "spec.json", Path(tmp) / "result.json"
            spec.write_text(json.dumps({"gguf": str(embedded_default_gguf()), "prompt": prompt,
                                        "output_len": args.output_len, "num_iters": args.num_iters,
                                        "threads": args.threads}))
            peer = Path(__file__).with_name("llama_cpp_peer.py")
            subprocess.run([args.llama_cpp_python, str(peer), str(spec), str(out)], check=True)
            r = json.loads(out.read_text())
        runs = [(t[0] * 1e3, (t[-1] - t[0]) * 1e3 / (len(t) - 1)) for t in r["token_times_s"]]
        ttft, tpot = min(x[0] for x in runs), min(x[1] for x in runs)
        print(f"{'llama.cpp q4_1':>15}: TTFT {ttft:7.1f} ms  TPOT {tpot:6.2f} ms  "
              f"x {base} {tpot / results[base].tpot_ms:.2f}")
        for name in ("gguf-q4_1", "gguf-q4_1-a8"):
            if name in results:
                print(f"vframe {name} / llama.cpp TPOT: {results[name].tpot_ms / tpot:.2f}x")


if __name__ == "__main__":
    main()
