"""``vframe bench throughput``: the offline workload on vframe and on a peer.

Workload (../shared/BENCHMARK.md): 64 requests, prompt lengths uniform in
[32, 512] and token ids drawn from the non-special ids with
``numpy.random.default_rng(0)``, 128 greedy output tokens each with
``ignore_eos``, all submitted at once, one warm-up request first.

Engines (``--backend``, vframe.bench.peers): vframe; transformers ``generate`` with
static left-padded batches; vLLM in the Python given by ``--peer-python``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from vframe.bench.peers import add_backend_args, run_backends, run_vllm_peer


@dataclass
class Result:
    backend: str
    dtype: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float  # the best (shortest) timed run
    startup_s: float
    num_preemptions: int = 0
    walls_s: list[float] = field(default_factory=list)  # every timed run, in order

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


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def add_offline_workload_args(parser: argparse.ArgumentParser) -> None:
    """The model, the offline workload's size, threads and ``--output-json``."""
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: embedded)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--min-input-len", type=int, default=32)
    parser.add_argument("--max-input-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (BENCHMARK.md: 2)")
    parser.add_argument("--num-iters", type=_at_least_one, default=1,
                        help="timed runs of the workload per engine after its warm-up; the best is reported")
    parser.add_argument("--output-json", default=None, help="also write the results to this file")


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    add_offline_workload_args(parser)
    add_backend_args(parser)
    parser.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of the hf peer")


def workload_prompts(args: argparse.Namespace, tokenizer, vocab_size: int) -> list[list[int]]:
    """The offline workload's prompts as ``args`` sizes them (``add_throughput_args``)."""
    return offline_prompts(
        vocab_size, set(tokenizer.all_special_ids), args.num_prompts, args.min_input_len, args.max_input_len
    )


def model_workload_prompts(args: argparse.Namespace) -> list[list[int]]:
    """``workload_prompts`` for ``args.model`` without building an engine."""
    from vframe.models.loader import load_hf_config, load_tokenizer, resolve_model

    resolved = resolve_model(args.model)
    return workload_prompts(args, load_tokenizer(resolved), load_hf_config(resolved).vocab_size)


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
    walls = []
    for _ in range(args.num_iters):
        llm.reset_prefix_cache()  # timing must not reuse the warm-up's (or an earlier run's) blocks
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
        walls.append(time.perf_counter() - t0)
    return Result(
        backend=backend,
        dtype=str(engine.runner_info.dtype).removeprefix("torch."),
        num_requests=len(prompts),
        prompt_tokens=sum(len(p) for p in prompts),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        wall_s=min(walls),
        startup_s=startup_s,
        num_preemptions=int(llm.get_stats()["num_preemptions"]),
        walls_s=walls,
    )


def load_hf(args: argparse.Namespace, dtype_name: str, device: str) -> tuple[Any, Any, float]:
    """transformers' tokenizer and model of ``args.model`` (a GGUF's dense conversion) on
    ``device``, with ``args.threads`` torch threads; and the seconds that took."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vframe.models.loader import resolve_model

    torch.set_num_threads(args.threads)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype_name]
    t0 = time.perf_counter()
    directory = resolve_model(args.model).model_dir
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval().to(device)
    return tokenizer, model, time.perf_counter() - t0


def run_hf(args: argparse.Namespace, dtype_name: str, device: str = "cpu") -> Result:
    """transformers ``generate`` with static left-padded batches on a dense copy, on ``device``."""
    import torch

    tokenizer, model, startup = load_hf(args, dtype_name, device)
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
    walls = []
    for _ in range(args.num_iters):
        t0 = time.perf_counter()
        output_tokens = sum(
            generate(prompts[i : i + args.hf_batch_size]) for i in range(0, len(prompts), args.hf_batch_size)
        )
        walls.append(time.perf_counter() - t0)
    return Result("hf", dtype_name, len(prompts), sum(len(p) for p in prompts), output_tokens, min(walls), startup,
                  walls_s=walls)


def print_result(result: Result) -> None:
    print(
        f"{result.backend:>7} [{result.dtype}]: {result.num_requests} requests, "
        f"{result.prompt_tokens} prompt + {result.output_tokens} output tokens in {result.wall_s:.1f} s | "
        f"output {result.output_tps:.1f} tok/s | total {result.total_tps:.1f} tok/s | "
        f"start-up {result.startup_s:.1f} s"
        + (f" | {result.num_preemptions} preemptions" if result.num_preemptions else "")
        + (f" (best of {len(result.walls_s)}; each run's s: {', '.join(f'{w:.1f}' for w in result.walls_s)})"
           if len(result.walls_s) > 1 else "")
    )


def run_vllm(args: argparse.Namespace, peer_python: str, dtype_name: str) -> Result:
    """vLLM in ``peer_python`` on the same prompts, after the same warm-up request."""
    prompts = model_workload_prompts(args)
    r = run_vllm_peer(
        peer_python, args.model, "throughput", prompts, prompts[0][:64], args.output_len, dtype_name, args.threads,
        num_iters=args.num_iters, ld_preload=args.peer_ld_preload,
    )
    walls = r.get("walls_s", [r["wall_s"]])
    return Result("vllm", dtype_name, r["num_requests"], r["prompt_tokens"], r["output_tokens"], min(walls),
                  r["startup_s"], walls_s=walls)


def run_throughput(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    results = run_backends(args, engine_kwargs, run_vframe, run_hf, run_vllm, print_result)
    for peer in results[1:] if results[0].backend == "vframe" else []:
        print(f"vframe / {peer.backend} output tokens/s: {results[0].output_tps / peer.output_tps:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([r.as_dict() for r in results], f, indent=2)
    return 0
