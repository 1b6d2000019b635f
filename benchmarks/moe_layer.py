"""Time of vframe's FusedMoE layer per token, for a growing number of experts at a fixed top-k.

    .venv/bin/python benchmarks/moe_layer.py                      # E = 8, 16, 32, 64; 64 tokens; top-2; bf16
    .venv/bin/python benchmarks/moe_layer.py --tokens 1 4 16 64 256 --experts 8 --grouped-mm

Router logits are random (every expert equally likely), so a batch of T tokens
touches about min(E, T * K) experts and the time follows that count: each
active expert's weights are read once. ``--route-to N`` sends every token to
the first N experts only, to time a fixed number of active experts as E grows.
Each line times the per-expert loop in Python on the stacked weights (``torch.mm``), on
the experts' oneDNN-packed matrices and, where ``cpu_ops.bf16_gemm`` runs (bfloat16 on a
CPU with AVX512-BF16), on bfloat16 pairs (``FusedMoE.process_weights_after_loading``), and
the packed layers bound (``+op``: ``bind_forward``, the whole layer one C++ operator, what a
loaded model runs); ``--grouped-mm`` also times the stacked layer with the loop replaced by
``torch.nn.functional.grouped_mm``.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.nn.functional as F

from vframe.layers import cpu_ops, moe


def grouped_mm_swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor, *_) -> torch.Tensor:
    offsets = counts.cumsum(0).to(torch.int32)  # [E] end of each expert's rows
    gate, up = F.grouped_mm(x, w13.transpose(1, 2), offs=offsets).chunk(2, dim=-1)  # [S, I] each
    return F.grouped_mm(F.silu(gate).mul_(up), w2.transpose(1, 2), offs=offsets)  # [S, H]


def best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64])
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--route-to", type=int, default=None, help="route only to the first N experts")
    parser.add_argument("--grouped-mm", action="store_true", help="also time F.grouped_mm in place of the loop")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    loop_swiglu = moe._grouped_swiglu
    routing = f"routed to the first {args.route_to} experts" if args.route_to else "uniform routing"
    print(f"H={args.hidden} I={args.intermediate} top-{args.top_k} {args.dtype}, {routing}, "
          f"{args.threads} threads, best of {args.repeats}")
    for num_experts in args.experts:
        layer = moe.FusedMoE(num_experts, args.hidden, args.intermediate, params_dtype=dtype)
        torch.nn.init.normal_(layer.w13_weight, std=0.02)
        torch.nn.init.normal_(layer.w2_weight, std=0.02)
        runs = {"stacked": (layer, loop_swiglu)}
        for name, bf16_gemm in (("onednn", "0"), ("pairs", "1")):
            os.environ["VFRAME_BF16_GEMM"] = bf16_gemm
            cpu_ops.bf16_gemm_available.cache_clear()
            packed = copy.deepcopy(layer)
            packed.process_weights_after_loading()
            if packed.w13_packed is None or (name == "pairs") != (packed.layout == moe.LAYOUT_BF16_PAIRS):
                continue
            bound = copy.deepcopy(packed) if name == "pairs" else packed  # oneDNN-packed tensors cannot be copied
            runs[name] = (packed, loop_swiglu)
            if name == "onednn":
                bound = moe.FusedMoE(num_experts, args.hidden, args.intermediate, params_dtype=dtype)
                bound.load_state_dict(layer.state_dict())
                bound.process_weights_after_loading()
            bound.bind_forward()
            if bound._bound is not None:
                runs[f"{name}+op"] = (bound, loop_swiglu)
        os.environ.pop("VFRAME_BF16_GEMM", None)
        cpu_ops.bf16_gemm_available.cache_clear()
        if args.grouped_mm:
            runs["grouped_mm"] = (layer, grouped_mm_swiglu)
        for num_tokens in args.tokens:
            generator = torch.Generator().manual_seed(0)
            x = torch.randn(num_tokens, args.hidden, generator=generator).to(dtype)  # [T, H]
            logits = torch.randn(num_tokens, num_experts, generator=generator)  # [T, E]
            if args.route_to is not None:
                logits[:, args.route_to :] = float("-inf")
            weights, ids = moe.softmax_topk(logits, args.top_k, renormalize=True)
            active = len(set(ids.flatten().tolist()))
            line = f"E={num_experts:3d} T={num_tokens:4d} active experts {active:3d}:"
            for name, (run, impl) in runs.items():
                moe._grouped_swiglu = impl
                with torch.inference_mode():
                    seconds = best_time(lambda: run(x, weights, ids), args.repeats)
                line += f"  {name} {seconds * 1e3:7.3f} ms = {seconds / num_tokens * 1e6:7.1f} us/token"
            moe._grouped_swiglu = loop_swiglu
            print(line)


if __name__ == "__main__":
    main()
