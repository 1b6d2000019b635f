"""``vframe bench lora``: the offline workload with LoRA adapters against the base model, same run.

The workload is ``vframe bench throughput``'s (64 prompts of 32-512 tokens, 128
greedy output tokens each, bfloat16 where the CPU runs it natively, else float32,
2 threads), timed three times in one process:

    base         an engine without enable_lora
    lora-base    an engine with enable_lora and max_loras adapters loaded, every request on the base model
    lora-NxR     the same engine, request i on adapter i % N (round-robin)

The adapters are random PEFT adapters of rank R written to a temporary
directory for the model being run: ``adapter_config.json`` and
``adapter_model.safetensors`` with ``lora_A`` / ``lora_B`` of every targeted
module of every layer (no ``peft`` needed). The loss is ``1 - lora / base`` in
output tokens/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from vframe.bench.throughput import Result, add_offline_workload_args, print_result, time_offline

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LORA_SETTINGS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_kernel")


def add_bench_lora_args(parser: argparse.ArgumentParser) -> None:
    add_offline_workload_args(parser)
    parser.add_argument("--num-adapters", type=int, default=4, help="adapters, assigned to the prompts round-robin")
    parser.add_argument("--rank", type=int, default=16, help="rank of every adapter")
    parser.add_argument("--targets", default=",".join(ALL_TARGETS),
                        help="comma-separated modules each adapter adapts in every layer")


def write_random_adapter(
    path: Path, shapes: dict[str, tuple[list[int], list[int]]], rank: int, *, seed: int
) -> Path:
    """A PEFT LoRA directory adapting each module of ``shapes`` (module -> shapes of ``lora_A``,
    ``lora_B``) with small random weights, ``lora_alpha = 2 * rank``."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    targets = sorted({module.rsplit(".", 1)[-1] for module in shapes})
    config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none",
        "lora_dropout": 0.0, "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "task_type": "CAUSAL_LM",
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (shape_a, shape_b) in shapes.items():
        # A ~ N(0, 1/in) and B ~ N(0, 0.01^2): deltas small next to the base output
        a = torch.randn(shape_a, generator=generator) / shape_a[1] ** 0.5  # [r, in]
        b = torch.randn(shape_b, generator=generator) * 0.01  # [out, r]
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def _build(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> tuple[Any, float]:
    from vframe import LLM
    from vframe.core.worker.model_runner import default_dtype_name

    t0 = time.perf_counter()
    dtype = default_dtype_name(engine_kwargs.get("device") or "auto")
    llm = LLM(**({"dtype": dtype} | engine_kwargs | {"model": args.model}))
    return llm, time.perf_counter() - t0


def _release(llm) -> None:
    llm.shutdown()
    del llm
    gc.collect()  # two engines' KV caches never coexist


def run_bench_lora(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    import torch

    from vframe import LoRARequest
    from vframe.errors import ConfigError

    torch.set_num_threads(args.threads)
    targets = {t for t in args.targets.split(",") if t}
    base_kwargs = {k: v for k, v in engine_kwargs.items() if k not in _LORA_SETTINGS}
    lora_kwargs = {"max_loras": args.num_adapters, "max_lora_rank": args.rank} | engine_kwargs | {"enable_lora": True}
    results: list[Result] = []

    llm, startup = _build(args, base_kwargs)
    results.append(time_offline(llm, args, "base", startup))
    print_result(results[-1])
    _release(llm)

    llm, startup = _build(args, lora_kwargs)
    shapes = llm.llm_engine.model_runner.lora_manager.target_shapes(args.rank)
    shapes = {module: s for module, s in shapes.items() if module.rsplit(".", 1)[-1] in targets}
    if not shapes:
        raise ConfigError(f"--targets {args.targets!r} names no layer of the model an adapter can target")
    with tempfile.TemporaryDirectory(prefix="vframe-bench-lora-") as tmp:
        adapters = [
            LoRARequest(f"bench{i}", i, str(write_random_adapter(Path(tmp) / f"bench{i}", shapes, args.rank, seed=i)))
            for i in range(1, args.num_adapters + 1)
        ]
        for adapter in adapters:
            llm.add_lora(adapter)
        results.append(time_offline(llm, args, "lora-base", startup))
        print_result(results[-1])
        results.append(time_offline(llm, args, f"lora-{args.num_adapters}x{args.rank}", startup, adapters))
        print_result(results[-1])
    _release(llm)

    base, enabled, lora = (r.output_tps for r in results)
    loss, enable_loss = 1 - lora / base, 1 - enabled / base
    print(f"enable_lora alone, base requests: {enable_loss:.1%} fewer output tokens/s than base")
    print(f"{args.num_adapters} adapters of rank {args.rank}, round-robin: loss 1 - lora / base = {loss:.1%}")
    if args.output_json:
        summary = {
            "results": [r.as_dict() for r in results],
            "num_adapters": args.num_adapters,
            "rank": args.rank,
            "targets": sorted(targets),
            "loss": loss,
            "enable_lora_loss": enable_loss,
        }
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0
