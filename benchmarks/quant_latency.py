"""Batch-1 latency of SmolLM2 quantized checkpoints against the same model in
bfloat16, and the embedded Q4_1 GGUF against llama.cpp, taking turns in one run (issue 13's
speed targets: int8 TPOT <= 0.7x bfloat16's, int4 <= 0.5x, GGUF Q4_1 <= llama.cpp's).

    .venv/bin/python benchmarks/quant_latency.py                       # every variant found
    .venv/bin/python benchmarks/quant_latency.py --llama-cpp-python /work/llama-venv/bin/python

The latency workload of ``vframe bench latency`` (../shared/BENCHMARK.md: one request,
256 prompt tokens, 128 greedy output tokens with ``ignore_eos``, after a warm-up, 2 threads)
on each variant:

- ``bf16``: the embedded SmolLM2 (its dense conversion) in bfloat16 (``--dtype float32``:
  ``float32``, and every variant in float32, for CPUs without native bfloat16);
- the llm-compressor / auto-round checkpoints that ``make test-quant`` caches in
  ``$VFRAME_CACHE_DIR/quant-checkpoints`` (W8A16 and W4A16 groups of 64, W8A8, GPTQ
  and AWQ 4 bit groups of 64, GPTQ 3 bit, NVFP4A16, MXFP4A16, bitsandbytes NF4 and LLM.int8; ``-head``: W8A16,
  W4A16 and GPTQ with the LM head quantized too, where the others keep SmolLM2's in bfloat16),
  bfloat16 activations; the kernel each layer got is shown;
- ``bnb-in-flight``: the dense conversion quantized to NF4 while loading (``quantization="bitsandbytes"``,
  vLLM's in-flight bitsandbytes; its "opened in" time includes the quantization);
- ``gguf-q4_1``: the embedded GGUF kept quantized (``quantization="gguf"``);
- ``gguf-q4_1-a8``: the same with ``quant_kernel="woq_cpu_a8"``: activations quantized to
  int8 per block of 32 for integer dot products, llama.cpp's own numerics;
- ``llama.cpp``: the same GGUF through ``llama-cpp-python`` in ``--llama-cpp-python``
  (its own environment; ``benchmarks/llama_cpp_peer.py``, a process a round), fed the same
  prompt ids.

Every vframe variant is opened (and warmed up) once, then ``--rounds`` rounds each time every
variant once, the order turned by one each round, and the dense model timed again between any
two: on a shared machine whose memory bandwidth moves by a third within seconds, variants timed
one after another compared their moments as much as their kernels. Reported per variant: the
median and best TTFT and TPOT over the rounds, and the ratio column: the median over rounds of
TPOT / the mean of the dense model's TPOT just before and just after it, with its range (the
GGUF against llama.cpp: TPOT / llama.cpp's in the same round).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from vframe.bench.latency import Timing, VframeLatency, _offline_args
from vframe.bench.throughput import model_workload_prompts
from vframe.models.loader.resolve import default_cache_dir, embedded_default_gguf

CHECKPOINTS = ("ct-w8a16", "ct-w8a16-head", "ct-w8a8", "ct-w4a16", "ct-w4a16-head", "ct-nvfp4a16", "ct-mxfp4a16",
               "ct-fp8-dynamic", "ct-fp8-block", "ct-mxfp8a16",
               "autoround-gptq", "autoround-gptq-head", "autoround-gptq-3bit", "autoround-awq", "bnb-nf4", "bnb-fp4",
               "bnb-int8")
KV_CACHE_BYTES = 256 << 20  # each open engine's KV budget: the workload needs 384 tokens


def llama_cpp_run(python: str, args: argparse.Namespace, prompt: list[int]) -> Timing:
    """One timed run of the GGUF through llama.cpp (after its warm-up), in its own process."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({"gguf": str(embedded_default_gguf()), "prompt": prompt,
                                    "output_len": args.output_len, "num_iters": 1, "threads": args.threads}))
        subprocess.run([python, str(Path(__file__).with_name("llama_cpp_peer.py")), str(spec), str(out)], check=True)
        [times] = json.loads(out.read_text())["token_times_s"]
    return Timing.from_token_times(times)


def ratio_text(ratios: list[float]) -> str:
    """The median of per-round ratios, and their range."""
    ratios = sorted(ratios)
    return f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp-python", default=None, help="a Python with llama-cpp-python")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of one timed run of every variant")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16",
                        help="vframe's dtype for every variant (float32 on CPUs without native bfloat16)")
    parser.add_argument("--only", default=None, help="comma-separated variant names")
    args = parser.parse_args()
    cache = default_cache_dir() / "quant-checkpoints"
    base = "bf16" if args.dtype == "bfloat16" else args.dtype
    variants: list[tuple[str, str | None, dict]] = [(base, None, {})]
    variants += [(name, str(cache / name), {}) for name in CHECKPOINTS if (cache / name).exists()]
    variants.append(("bnb-in-flight", None, {"quantization": "bitsandbytes"}))
    variants.append(("gguf-q4_1", None, {"quantization": "gguf"}))
    variants.append(("gguf-q4_1-a8", None, {"quantization": "gguf", "quant_kernel": "woq_cpu_a8"}))
    if args.only:
        keep = set(args.only.split(","))
        variants = [v for v in variants if v[0] in keep or v[0] == base]

    opened: dict[str, VframeLatency] = {}
    for name, model, extra in variants:
        args.model = model
        opened[name] = VframeLatency(args, {"dtype": args.dtype, "num_threads": args.threads,
                                            "kv_cache_memory_bytes": KV_CACHE_BYTES, **extra})
        print(f"{name:>15}: opened in {opened[name].startup_s:.1f} s, kernels: {kernels_of(opened[name].llm)}",
              flush=True)
    others = [name for name in opened if name != base] + (["llama.cpp"] if args.llama_cpp_python else [])
    if args.llama_cpp_python:  # the embedded GGUF's tokens of the workload's prompt, for llama.cpp
        args.model = None
        [peer_prompt] = model_workload_prompts(_offline_args(args))
    runs: dict[str, list[Timing]] = {name: [] for name in [base, *others]}
    around: dict[str, list[float]] = {name: [] for name in others}  # the base's TPOT just before and after
    for r in range(args.rounds):
        before = opened[base].run()
        runs[base].append(before)
        for name in others[r % len(others):] + others[: r % len(others)]:
            if name == "llama.cpp":
                timing = llama_cpp_run(args.llama_cpp_python, args, peer_prompt)
            else:
                timing = opened[name].run()
            after = opened[base].run()
            runs[name].append(timing)
            runs[base].append(after)
            around[name].append((before.tpot_ms + after.tpot_ms) / 2)
            before = after
        print(f"round {r + 1}: " + "  ".join(f"{n} {runs[n][-1].tpot_ms:.2f}" for n in others), flush=True)
    for bench in opened.values():
        bench.shutdown()

    print(f"\n{'':>15}  TTFT median (best)   TPOT median (best)   TPOT / {base} around it: median (range)")
    for name in [base, *others]:
        ttft = statistics.median(t.ttft_ms for t in runs[name])
        tpot = statistics.median(t.tpot_ms for t in runs[name])
        ratio = "" if name == base else ratio_text([t.tpot_ms / b for t, b in zip(runs[name], around[name])])
        print(f"{name:>15}: {ttft:7.1f} ({min(t.ttft_ms for t in runs[name]):7.1f}) ms  "
              f"{tpot:6.2f} ({min(t.tpot_ms for t in runs[name]):6.2f}) ms  {ratio}")
    if "llama.cpp" in runs:
        for name in ("gguf-q4_1", "gguf-q4_1-a8"):
            if name in runs:
                ratios = [t.tpot_ms / p.tpot_ms for t, p in zip(runs[name], runs["llama.cpp"])]
                print(f"vframe {name} / llama.cpp TPOT (same round): {ratio_text(ratios)}")


def kernels_of(llm) -> str:
    """The quant kernels the engine's linear layers run on, with their counts."""
    counts = Counter(
        getattr(getattr(m.quant_method, "kernel", None), "name", None) or type(m.quant_method).__name__
        for m in llm.llm_engine.model_runner.model.modules()
        if hasattr(m, "quant_method")
    )
    return ", ".join(f"{name} x{n}" for name, n in counts.most_common())


if __name__ == "__main__":
    main()
