"""``vframe bench latency``: one request's time to first token and time per output token.

Workload (../shared/BENCHMARK.md): 1 request, a 256-token prompt of non-special ids
(the offline workload's generator, ``numpy.random.default_rng(0)``, with one prompt of
exactly ``--input-len`` tokens), 128 greedy output tokens with ``ignore_eos``. One
warm-up run of the same request, then ``--num-iters`` (3) timed runs, the prefix cache
emptied before each; the best TTFT and the best TPOT are reported.

Each engine streams the request and the clock starts when it is handed over:

- vframe and vLLM: ``LLMEngine.add_request`` with ``output_kind="delta"``, then
  ``step()`` until it finishes (``vllm_peer.timed_request``, one function for both); a
  token's time is when the step that delivered it returns.
- transformers: ``generate()`` with a streamer, whose ``put`` is called with each new
  token as soon as it is sampled.

TTFT = the first token's time; TPOT = (last token's time - first's) / (output tokens - 1).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from vframe.bench.peers import add_backend_args, run_backends, run_vllm_peer
from vframe.bench.throughput import load_hf, model_workload_prompts, workload_prompts
from vframe.bench.vllm_peer import timed_request
from vframe.errors import ConfigError


@dataclass
class Timing:
    ttft_ms: float
    tpot_ms: float
    output_tokens: int

    @classmethod
    def from_token_times(cls, token_times_s: list[float]) -> Timing:
        """From each output token's seconds since the request was handed over."""
        first, last, n = token_times_s[0], token_times_s[-1], len(token_times_s)
        return cls(1e3 * first, 1e3 * (last - first) / (n - 1), n)


@dataclass
class LatencyResult:
    backend: str
    dtype: str
    prompt_tokens: int
    runs: list[Timing]
    startup_s: float

    @property
    def ttft_ms(self) -> float:
        return min(r.ttft_ms for r in self.runs)

    @property
    def tpot_ms(self) -> float:
        return min(r.tpot_ms for r in self.runs)

    @property
    def output_tokens(self) -> int:
        return min(r.output_tokens for r in self.runs)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "output_tokens": self.output_tokens}


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: embedded)")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens (at least 2)")
    parser.add_argument("--num-iters", type=int, default=3, help="timed runs; the best TTFT and TPOT are reported")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (BENCHMARK.md: 2)")
    parser.add_argument("--output-json", default=None, help="also write the results to this file")
    add_backend_args(parser)


def _offline_args(args: argparse.Namespace) -> argparse.Namespace:
    """The offline workload's generator sized to one prompt of ``--input-len`` tokens."""
    return argparse.Namespace(
        model=args.model, num_prompts=1, min_input_len=args.input_len, max_input_len=args.input_len
    )


class VframeLatency:
    """A vframe engine opened for the latency workload, warmed up: ``run()`` times the request
    once (the prefix cache emptied first). ``run_vframe`` takes ``--num-iters`` runs of one;
    ``benchmarks/quant_latency.py`` holds several open and takes turns."""

    def __init__(self, args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> None:
        import torch

        from vframe import LLM, SamplingParams
        from vframe.core.worker.model_runner import default_dtype_name

        torch.set_num_threads(args.threads)
        engine_kwargs.setdefault("dtype", default_dtype_name(engine_kwargs.get("device") or "auto"))
        t0 = time.perf_counter()
        self.llm = LLM(**(engine_kwargs | {"model": args.model}))
        self.startup_s = time.perf_counter() - t0
        self.engine = self.llm.llm_engine
        [self.prompt] = workload_prompts(_offline_args(args), self.engine.tokenizer, self.engine.vocab_size)
        self.params = SamplingParams(
            temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False, output_kind="delta"
        )
        self.dtype = str(self.engine.runner_info.dtype).removeprefix("torch.")
        self.runs = 0
        timed_request(self.engine, "warmup", self.prompt, self.params)

    def run(self) -> Timing:
        self.llm.reset_prefix_cache()
        self.runs += 1
        return Timing.from_token_times(timed_request(self.engine, f"timed-{self.runs}", self.prompt, self.params))

    def result(self, runs: list[Timing]) -> LatencyResult:
        return LatencyResult("vframe", self.dtype, len(self.prompt), runs, self.startup_s)

    def shutdown(self) -> None:
        self.llm.shutdown()


def run_vframe(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> LatencyResult:
    bench = VframeLatency(args, engine_kwargs)
    runs = [bench.run() for _ in range(args.num_iters)]
    bench.shutdown()
    return bench.result(runs)


def run_hf(args: argparse.Namespace, dtype_name: str, device: str) -> LatencyResult:
    """transformers ``generate`` on the dense copy, one request, timed by a streamer."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class TokenClock(BaseStreamer):
        def __init__(self) -> None:
            self.t0 = time.perf_counter()
            self.token_times_s: list[float] = []
            self.prompt_seen = False

        def put(self, value: torch.Tensor) -> None:
            if not self.prompt_seen:  # generate() hands over the prompt first
                self.prompt_seen = True
                return
            self.token_times_s.extend([time.perf_counter() - self.t0] * value.numel())

        def end(self) -> None:
            pass

    tokenizer, model, startup = load_hf(args, dtype_name, device)
    [prompt] = workload_prompts(_offline_args(args), tokenizer, model.config.vocab_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def timed_generate() -> list[float]:
        ids = torch.tensor([prompt], device=device)
        clock = TokenClock()
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.output_len,
                min_new_tokens=args.output_len, pad_token_id=pad_id, streamer=clock,
            )
        return clock.token_times_s

    timed_generate()  # warm-up
    runs = [Timing.from_token_times(timed_generate()) for _ in range(args.num_iters)]
    return LatencyResult("hf", dtype_name, len(prompt), runs, startup)


def run_vllm(args: argparse.Namespace, peer_python: str, dtype_name: str) -> LatencyResult:
    [prompt] = model_workload_prompts(_offline_args(args))
    r = run_vllm_peer(
        peer_python, args.model, "latency", [prompt], prompt, args.output_len, dtype_name, args.threads,
        num_iters=args.num_iters, ld_preload=args.peer_ld_preload,
    )
    runs = [Timing.from_token_times(times) for times in r["token_times_s"]]
    return LatencyResult("vllm", dtype_name, r["prompt_tokens"], runs, r["startup_s"])


def print_result(result: LatencyResult) -> None:
    each = ", ".join(f"{r.ttft_ms:.0f}/{r.tpot_ms:.1f}" for r in result.runs)
    print(
        f"{result.backend:>7} [{result.dtype}]: {result.prompt_tokens} prompt + {result.output_tokens} output tokens | "
        f"TTFT {result.ttft_ms:.1f} ms | TPOT {result.tpot_ms:.2f} ms (best of {len(result.runs)}; "
        f"TTFT/TPOT ms each run: {each}) | start-up {result.startup_s:.1f} s"
    )


def run_latency(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    if args.output_len < 2:
        raise ConfigError(f"--output-len {args.output_len}: TPOT needs at least 2 output tokens; pass 2 or more")
    if args.num_iters < 1 or args.input_len < 1:
        raise ConfigError(
            f"--num-iters {args.num_iters} --input-len {args.input_len}: both must be at least 1"
        )
    results = run_backends(args, engine_kwargs, run_vframe, run_hf, run_vllm, print_result)
    for peer in results[1:] if results[0].backend == "vframe" else []:
        ours = results[0]
        print(
            f"vframe / {peer.backend} time: TTFT {ours.ttft_ms / peer.ttft_ms:.2f}x, "
            f"TPOT {ours.tpot_ms / peer.tpot_ms:.2f}x (below 1: vframe is faster)"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([r.as_dict() for r in results], f, indent=2)
    return 0
