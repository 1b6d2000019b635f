"""Time of one decode step of the embedded SmolLM2 per attention backend, in one run.

    .venv/bin/python benchmarks/decode_step.py                         # torch,cpu_paged; 32 x 256; 1 thread
    .venv/bin/python benchmarks/decode_step.py --batch 64 --prompt-len 512 --threads 2

Each backend gets ``--batch`` prompts of ``--prompt-len`` random token ids (one
generator seed for all), prefilled; then ``--steps`` decode steps of the whole batch
are timed one by one. Reported: the median and the best step, as process CPU time
(``time.process_time``: other jobs on a shared machine inflate wall time, not this
process's CPU time; with more than one thread it adds the threads' times) and as wall
time. The backends alternate over ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from vframe import LLM, SamplingParams


def decode_steps(backend: str, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    llm = LLM(dtype=args.dtype, attention_backend=backend, enable_prefix_caching=False, num_threads=args.threads)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True, temperature=0.0, detokenize=False)
    for i in range(args.batch):
        engine.add_request(str(i), {"prompt_token_ids": rng.integers(100, 40000, args.prompt_len).tolist()}, params)
    running = engine.scheduler.running
    while not (len(running) == args.batch and all(r.num_computed_tokens >= args.prompt_len for r in running)):
        engine.step()
    engine.step()
    cpu, wall = [], []
    for _ in range(args.steps):
        c, w = time.process_time(), time.perf_counter()
        engine.step()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="torch,cpu_paged")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    for r in range(args.rounds):
        for backend in args.backends.split(","):
            cpu, wall = decode_steps(backend, args)
            print(
                f"round {r} {backend:>10}: decode step CPU {statistics.median(cpu) * 1e3:7.1f} ms median, "
                f"{min(cpu) * 1e3:7.1f} best; wall {statistics.median(wall) * 1e3:7.1f} ms median",
                flush=True,
            )


if __name__ == "__main__":
    main()
