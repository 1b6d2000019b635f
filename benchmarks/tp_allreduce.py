"""What tensor parallelism costs per engine step on this machine: the gloo
collectives one decode (or prefill) step of a SmolLM2-sized model runs.

    .venv/bin/python benchmarks/tp_allreduce.py                    # 2 ranks, bfloat16 and float32
    .venv/bin/python benchmarks/tp_allreduce.py --ranks 3 --tokens 1 32 512

A Llama step over ``T`` tokens all-reduces ``[T, hidden]`` twice per layer (after
the attention's o_proj and the MLP's down_proj), once more for the token
embedding, and all-gathers the ``[B, vocab / ranks]`` logits of the ``B`` sampled
rows. Each collective is timed alone (median of ``--repeats``, after a warm-up)
between ``--ranks`` processes with one thread each; the per-step estimate is
``(2 * layers + 1) * all_reduce + all_gather``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def timed(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def rank_main(rank: int, args: argparse.Namespace, init_file: str, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.ranks)
    for dtype in (torch.bfloat16, torch.float32):
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden, dtype=dtype)
            reduce_s = timed(lambda: dist.all_reduce(x), args.repeats)
            rows = min(tokens, args.max_sampled)
            shard = torch.randn(rows, -(-args.vocab // args.ranks), dtype=torch.float32)
            parts = [torch.empty_like(shard) for _ in range(args.ranks)]
            gather_s = timed(lambda: dist.all_gather(parts, shard), args.repeats)
            if rank == 0:
                results[(str(dtype).removeprefix("torch."), tokens)] = (reduce_s, gather_s, rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 256, 2048])
    parser.add_argument("--hidden", type=int, default=576, help="SmolLM2-135M: 576")
    parser.add_argument("--layers", type=int, default=30, help="SmolLM2-135M: 30")
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2-135M: 49152")
    parser.add_argument("--max-sampled", type=int, default=32, help="rows whose logits are gathered per step")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(args, os.path.join(tmp, "rendezvous"), results), nprocs=args.ranks)
        results = dict(results)
    print(f"{args.ranks} ranks (gloo, 1 thread each), hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}")
    print(f"{'dtype':>9} {'tokens':>6} {'all_reduce us':>14} {'all_gather us':>14} {'per step ms':>12}")
    for (dtype, tokens), (reduce_s, gather_s, rows) in sorted(results.items()):
        step = (2 * args.layers + 1) * reduce_s + gather_s
        print(f"{dtype:>9} {tokens:>6} {reduce_s * 1e6:>14.1f} {gather_s * 1e6:>14.1f} {step * 1e3:>12.2f}"
              f"   (logits of {rows} rows gathered)")


if __name__ == "__main__":
    main()
