"""``vframe bench serve``: the serving workload against an OpenAI-compatible server.

Workload (../shared/BENCHMARK.md): the offline workload's prompts (64 prompts of
32-512 random non-special token ids, ``numpy.random.default_rng(0)``), each sent
to ``/v1/completions`` as token ids with ``stream: true``, 128 greedy output
tokens with ``ignore_eos``, by ``C`` concurrent clients for each ``C`` in
``--concurrency`` (1, 4, 16), after one warm-up request.

Per request: TTFT (request sent -> first chunk with text), ITL (gaps between
chunks with text), TPOT ((latency - TTFT) / (output tokens - 1), output tokens
from the final usage chunk). Per level: request/s and output tokens/s over the
level's wall time; mean, p50 and p99 of each latency.

Without ``--base-url`` a vframe server is started for the run (and stopped
after) with the engine flags given here, bfloat16, and prefix caching off: the
levels send the same prompts, and a cache warmed by one level would skip the
next level's prefills.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from vframe.bench.throughput import model_workload_prompts


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", default=None,
        help="server to measure, e.g. http://127.0.0.1:8000/v1 (default: start a vframe server for the run)",
    )
    parser.add_argument("--model", default=None, help="GGUF file or HF directory: its tokenizer draws the prompts "
                        "and a started server serves it (default: embedded SmolLM2)")
    parser.add_argument("--served-model-name", default=None,
                        help="'model' sent in requests (default: the first of the server's /v1/models)")
    parser.add_argument("--api-key", default=None, help="bearer token for the server (default: $VFRAME_API_KEY)")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts, one level each")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--min-input-len", type=int, default=32)
    parser.add_argument("--max-input-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of a started server (BENCHMARK.md: 2)")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--output-json", default=None, help="also write the results to this file")


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    latency: float = 0.0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class LevelResult:
    concurrency: int
    num_requests: int
    num_failed: int
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    first_error: str | None = None

    @property
    def request_rate(self) -> float:
        return (self.num_requests - self.num_failed) / self.wall_s

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    ms = np.asarray(values) * 1000.0
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}


# --------------------------------------------------------------------------- #
# the client
# --------------------------------------------------------------------------- #


async def _send(client: Any, url: str, body: dict[str, Any], headers: dict[str, str]) -> RequestResult:
    result = RequestResult(ok=False, prompt_tokens=len(body["prompt"]))
    start = last = time.perf_counter()
    num_chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(choice.get("text") for choice in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                    num_chunks += 1
    except Exception as e:  # a refused connection, a timeout: count it, keep measuring
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or num_chunks
    result.ok = True
    return result


def _body(model: str, prompt: list[int], output_len: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _run_level(
    client: Any, url: str, model: str, prompts: list[list[int]], output_len: int, concurrency: int,
    headers: dict[str, str],
) -> LevelResult:
    semaphore = asyncio.Semaphore(concurrency)

    async def limited(prompt: list[int]) -> RequestResult:
        async with semaphore:
            return await _send(client, url, _body(model, prompt, output_len), headers)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(limited(p) for p in prompts))
    wall = time.perf_counter() - t0
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    return LevelResult(
        concurrency=concurrency,
        num_requests=len(results),
        num_failed=len(failed),
        wall_s=wall,
        prompt_tokens=sum(r.prompt_tokens for r in done),
        output_tokens=sum(r.output_tokens for r in done),
        ttft_ms=_summary([r.ttft for r in done if r.ttft is not None]),
        tpot_ms=_summary([t for r in done if (t := r.tpot) is not None]),
        itl_ms=_summary([gap for r in done for gap in r.itls]),
        first_error=failed[0].error if failed else None,
    )


async def _bench(args: argparse.Namespace, base_url: str, prompts: list[list[int]]) -> list[LevelResult]:
    import httpx

    api_key = args.api_key or os.environ.get("VFRAME_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    limits = httpx.Limits(max_connections=max(levels), max_keepalive_connections=max(levels))
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        model = args.served_model_name
        if model is None:
            response = await client.get(f"{base_url}/models", headers=headers)
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        url = f"{base_url}/completions"
        warm = await _send(client, url, _body(model, prompts[0][:64], 16), headers)
        if not warm.ok:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        results = []
        for concurrency in levels:
            results.append(await _run_level(client, url, model, prompts, args.output_len, concurrency, headers))
            _print(results[-1])
        return results


# --------------------------------------------------------------------------- #
# a vframe server for the run
# --------------------------------------------------------------------------- #


def _server_flags(engine_kwargs: dict[str, Any]) -> list[str]:
    flags: list[str] = []
    for name, value in engine_kwargs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, list):
            flags += [flag, ",".join(value)]
        else:
            flags += [flag, str(value)]
    return flags


@contextmanager
def started_server(
    model: str | None, engine_kwargs: dict[str, Any], config_file: str | None, timeout_s: float = 300.0
) -> Iterator[str]:
    """Start ``vframe serve`` on a free loopback port; yield its base URL; stop it (SIGTERM)."""
    import httpx

    command = [sys.executable, "-m", "vframe.entrypoints.cli", "serve", "--port", "0", "--no-access-log"]
    if model is not None:
        command.append(model)
    if config_file is not None:
        command += ["--config", config_file]
    command += _server_flags(engine_kwargs)
    # A SIGTERM to the benchmark must still stop the server (the finally below).
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with tempfile.NamedTemporaryFile("w+", prefix="vframe-serve-", suffix=".log") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            base_url = _wait_until_serving(process, log.name, timeout_s)
            deadline = time.monotonic() + timeout_s
            while httpx.get(base_url.removesuffix("/v1") + "/health").status_code != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError("the vframe server never became healthy")
                time.sleep(0.2)
            yield base_url
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            signal.signal(signal.SIGTERM, previous)


def _wait_until_serving(process: subprocess.Popen, log_path: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    pattern = re.compile(r"serving .* on (http://\S+/v1)")
    while time.monotonic() < deadline:
        with open(log_path) as f:
            text = f.read()
        match = pattern.search(text)
        if match:
            return match.group(1)
        if process.poll() is not None:
            raise RuntimeError(f"the vframe server exited with status {process.returncode}:\n{text[-3000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"the vframe server did not start within {timeout_s:.0f} s")


# --------------------------------------------------------------------------- #


def _print(r: LevelResult) -> None:
    def fmt(s: dict[str, float]) -> str:
        return f"{s['mean']:7.1f} {s['p50']:7.1f} {s['p99']:7.1f}"

    failed = f" ({r.num_failed} failed: {r.first_error})" if r.num_failed else ""
    print(
        f"concurrency {r.concurrency:>3}: {r.num_requests} requests in {r.wall_s:6.1f} s | "
        f"{r.request_rate:5.2f} req/s | output {r.output_tps:6.1f} tok/s | ms mean/p50/p99: "
        f"TTFT {fmt(r.ttft_ms)} | TPOT {fmt(r.tpot_ms)} | ITL {fmt(r.itl_ms)}{failed}",
        flush=True,
    )


def run_bench_serve(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    prompts = model_workload_prompts(args)
    print(
        f"serving workload: {len(prompts)} prompts ({sum(map(len, prompts))} tokens), "
        f"{args.output_len} output tokens each, concurrency {args.concurrency}",
        flush=True,
    )
    engine_kwargs.pop("model", None)  # --model names the tokenizer here, and the served model below
    if args.base_url is not None:
        if engine_kwargs:
            print(f"note: engine settings {sorted(engine_kwargs)} are ignored with --base-url", file=sys.stderr)
        results = asyncio.run(_bench(args, args.base_url.rstrip("/"), prompts))
    else:
        from vframe.core.worker.model_runner import default_dtype_name

        engine_kwargs.setdefault("dtype", default_dtype_name(engine_kwargs.get("device") or "auto"))
        engine_kwargs.setdefault("num_threads", args.threads)
        engine_kwargs.setdefault("enable_prefix_caching", False)
        with started_server(args.model, engine_kwargs, getattr(args, "config_file", None)) as base_url:
            results = asyncio.run(_bench(args, base_url, prompts))
    if args.output_json:
        with open(args.output_json, "w") as f:
            rows = [asdict(r) | {"request_rate": r.request_rate, "output_tps": r.output_tps} for r in results]
            json.dump(rows, f, indent=2)
    return 1 if any(r.num_failed for r in results) else 0
