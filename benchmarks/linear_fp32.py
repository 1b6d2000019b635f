"""The linear products of one SmolLM2 decode step: ``F.linear`` (MKL for float32,
oneDNN with a per-call reorder for bfloat16) against oneDNN with the weight packed
once, as vframe runs them (vframe/quant/onednn_packed.py), in one run.

    .venv/bin/python benchmarks/linear_fp32.py                       # float32, rows 1, 4, 16, 64, 256
    .venv/bin/python benchmarks/linear_fp32.py --dtype bfloat16 --rows 1,64

Per row count: each product's time (best of ``--rounds`` medians) and the step's
total, 30 layers of q/k/v, o, gate/up and down plus the LM head, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from vframe.quant.onednn_packed import packed_linear

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536, vocabulary 49152
SHAPES = {"qkv": (576, 960, 30), "o": (576, 576, 30), "gate_up": (576, 3072, 30), "down": (1536, 576, 30),
          "lm_head": (576, 49152, 1)}  # name: (in, out, calls per step)  # fmt: skip


def timed(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    for rows in (int(r) for r in args.rows.split(",")):
        total_plain = total_packed = 0.0
        for name, (k, n, per_step) in SHAPES.items():
            x, w = torch.randn(rows, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            calls = 20 if n > 10_000 else 100
            plain = min(timed(lambda: F.linear(x, w), calls) for _ in range(args.rounds))
            onednn = min(
                timed(lambda: packed_linear(x, packed, None), calls)
                for _ in range(args.rounds)
            )
            total_plain += plain * per_step
            total_packed += onednn * per_step
            print(f"rows {rows:4d} {name:>8} [{k} x {n}]: F.linear {plain * 1e3:8.3f} ms, "
                  f"packed oneDNN {onednn * 1e3:8.3f} ms ({plain / onednn:.2f}x)")  # fmt: skip
        print(f"rows {rows:4d} step ({args.dtype}, {args.threads} threads): F.linear {total_plain * 1e3:.1f} ms, "
              f"packed oneDNN {total_packed * 1e3:.1f} ms: {total_plain / total_packed:.2f}x\n")  # fmt: skip


if __name__ == "__main__":
    main()
