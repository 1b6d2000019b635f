"""``vframe bench throughput``: the offline workload on vframe and on a peer.

Workload (../shared/BENCHMARK.md): 64 requests, prompt lengths uniform in
[32, 512] and token ids drawn from the non-special ids with
``numpy.random.default_rng(0)``, 128 greedy output tokens each with
``ignore_eos``, all submitted at once, one warm-up request first.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass
class Result:
    backend: str
    dtype: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    startup_s: float
    num_preemptions: int = 0

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"output_tps": self.output_tps, "total_tps": self.total_tps}


def offline_prompts(
    vocab_size: int, special_ids: set[int], num_requests: int = 64, min_len: int = 32, max_len: int = 512, seed: int = 0
) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    allowed = np.array([i for i in range(vocab_size) if i not in special_ids])
    lengths = rng.integers(min_len, max_len + 1, size=num_requests)
    return [allowed[rng.integers(0, len(allowed), size=n)].tolist() for n in lengths]


def add_offline_workload_args(parser: argparse.ArgumentParser) -> None:
    """The model, the offline workload's size, threads and ``--output-json``."""
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: embedded)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--min-input-len", type=int, default=32)
    parser.add_argument("--max-input-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (BENCHMARK.md: 2)")
    parser.add_argument("--output-json", default=None, help="also write the results to this file")


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    add_offline_workload_args(parser)
    parser.add_argument("--backend", choices=["vframe", "hf", "both"], default="vframe",
                        help="engine to run: vframe, transformers (hf), or both with their ratio")
    parser.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of the hf peer")


def workload_prompts(args: argparse.Namespace, tokenizer, vocab_size: int) -> list[list[int]]:
    """The offline workload's prompts as ``args`` sizes them (``add_throughput_args``)."""
    return offline_prompts(
        vocab_size, set(tokenizer.all_special_ids), args.num_prompts, args.min_input_len, args.max_input_len
    )


def run_vframe(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> Result:
    import torch

    from vframe import LLM

    from vframe.core.worker.model_runner import default_dtype_name

    torch.set_num_threads(args.threads)
    engine_kwargs.setdefault("dtype", default_dtype_name(engine_kwargs.get("device") or "auto"))
    t0 = time.perf_counter()
    llm = LLM(**(engine_kwargs | {"model": args.model}))  # --model is also an engine setting
    startup = time.perf_counter() - t0
    return time_offline(llm, args, "vframe", startup)


def time_offline(
    llm, args: argparse.Namespace, backend: str, startup_s: float, lora_requests: list | None = None
) -> Result:
    """Time the offline workload on a built ``LLM``, after a warm-up; ``lora_requests``: one
    ``LoRARequest`` (or None) per prompt, cycled, each distinct one warmed up."""
    from vframe import SamplingParams

    engine = llm.llm_engine
    prompts = workload_prompts(args, engine.tokenizer, engine.vocab_size)
    loras = [lora_requests[i % len(lora_requests)] for i in range(len(prompts))] if lora_requests else None
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    warm_loras = list(dict.fromkeys(loras)) if loras else [None]
    llm.generate([{"prompt_token_ids": prompts[0][:64]}] * len(warm_loras), params, use_tqdm=False,
                 lora_request=warm_loras)  # warm-up
    llm.reset_prefix_cache()  # timing must not reuse the warm-up's blocks
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    wall = time.perf_counter() - t0
    return Result(
        backend=backend,
        dtype=str(engine.model_runner.dtype).removeprefix("torch."),
        num_requests=len(prompts),
        prompt_tokens=sum(len(p) for p in prompts),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        wall_s=wall,
        startup_s=startup_s,
        num_preemptions=int(llm.get_stats()["num_preemptions"]),
    )


def run_hf(args: argparse.Namespace, dtype_name: str, device: str = "cpu") -> Result:
    """transformers ``generate`` with static left-padded batches on a dense copy, on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vframe.models.loader import resolve_model

    torch.set_num_threads(args.threads)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype_name]
    t0 = time.perf_counter()
    directory = resolve_model(args.model).model_dir  # a GGUF's dense conversion
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval().to(device)
    startup = time.perf_counter() - t0
    prompts = workload_prompts(args, tokenizer, model.config.vocab_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate(batch: list[list[int]]) -> int:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False, max_new_tokens=args.output_len,
                min_new_tokens=args.output_len, pad_token_id=pad_id,
            )
        return (out.shape[1] - width) * len(batch)

    generate([prompts[0][:64]])  # warm-up
    t0 = time.perf_counter()
    output_tokens = sum(
        generate(prompts[i : i + args.hf_batch_size]) for i in range(0, len(prompts), args.hf_batch_size)
    )
    wall = time.perf_counter() - t0
    return Result("hf", dtype_name, len(prompts), sum(len(p) for p in prompts), output_tokens, wall, startup)


def print_result(result: Result) -> None:
    print(
        f"{result.backend:>7} [{result.dtype}]: {result.num_requests} requests, "
        f"{result.prompt_tokens} prompt + {result.output_tokens} output tokens in {result.wall_s:.1f} s | "
        f"output {result.output_tps:.1f} tok/s | total {result.total_tps:.1f} tok/s | "
        f"start-up {result.startup_s:.1f} s"
        + (f" | {result.num_preemptions} preemptions" if result.num_preemptions else "")
    )


def run_throughput(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    results: list[Result] = []
    if args.backend in ("vframe", "both"):
        results.append(run_vframe(args, dict(engine_kwargs)))
        print_result(results[-1])
    if args.backend in ("hf", "both"):
        import torch

        from vframe.core.worker.model_runner import default_dtype_name

        device = engine_kwargs.get("device") or "auto"
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = engine_kwargs.get("dtype") or default_dtype_name(device)
        results.append(run_hf(args, dtype, device))
        print_result(results[-1])
    if len(results) == 2:
        print(f"vframe / hf output tokens/s: {results[0].output_tps / results[1].output_tps:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([r.as_dict() for r in results], f, indent=2)
    return 0
