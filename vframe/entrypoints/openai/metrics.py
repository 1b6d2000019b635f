"""Prometheus metrics of the server, served at ``/metrics``.

Names follow vLLM's (``vllm:`` becomes ``vframe:``) so that dashboards carry over.
Counters and histograms are updated as requests run; the engine's live numbers
(running, waiting, KV usage, prefix cache) are read from the engine thread's
latest snapshot when Prometheus scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vframe.core.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class EngineStatsCollector(Collector):
    """``LLMEngine.get_stats()`` as gauges and counters, read at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily(
            "vframe:num_requests_running", "Sequences in the running batch.", value=s.get("num_running", 0)
        )
        yield GaugeMetricFamily(
            "vframe:num_requests_waiting", "Sequences waiting to be scheduled.", value=s.get("num_waiting", 0)
        )
        yield CounterMetricFamily(
            "vframe:num_preemptions",
            "Preemptions since start (a preempted sequence gives back its KV blocks and waits).",
            value=s.get("num_preemptions", 0),
        )
        yield GaugeMetricFamily(
            "vframe:kv_cache_usage_perc",
            "Fraction of KV cache blocks in use by requests (0 to 1).",
            value=s.get("kv_cache_usage", 0.0),
        )
        queries = s.get("prefix_cache_queries", 0)
        hits = s.get("prefix_cache_hits", 0)
        yield CounterMetricFamily(
            "vframe:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", value=queries
        )
        yield CounterMetricFamily(
            "vframe:prefix_cache_hits", "Prompt tokens found in the prefix cache.", value=hits
        )
        yield GaugeMetricFamily(
            "vframe:prefix_cache_hit_rate",
            "prefix_cache_hits / prefix_cache_queries since start.",
            value=hits / queries if queries else 0.0,
        )


class ServerMetrics:
    """The server's registry. One per app, so that tests and several apps in one
    process never share counters."""

    def __init__(self, engine_stats: Callable[[], dict[str, float]]) -> None:
        disable_created_metrics()
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            "vframe:http_requests", "HTTP requests by endpoint and status code.", ["endpoint", "status"], registry=r
        )
        self.requests_finished = Counter(
            "vframe:requests_finished",
            "Generated sequences by finish reason (a request with n=2 counts twice; "
            "abort = the client went away or the server shut down).",
            ["finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("vframe:prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter("vframe:generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram(
            "vframe:time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "vframe:time_per_output_token_seconds",
            "Mean time between a finished request's generated tokens after the first.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vframe:e2e_request_latency_seconds",
            "From a request's arrival to its last token (finished requests only).",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        r.register(EngineStatsCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Times one engine request (one prompt, ``n`` sequences) into ``ServerMetrics``."""

    def __init__(self, metrics: ServerMetrics, arrival: float, num_prompt_tokens: int) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens: dict[int, int] = {}  # completion index -> tokens so far
        self.finish_reasons: dict[int, str] = {}
        metrics.prompt_tokens.inc(num_prompt_tokens)

    def observe(self, output: RequestOutput) -> None:
        now = time.perf_counter()
        new_tokens = 0
        for completion in output.outputs:
            new_tokens += len(completion.token_ids)
            self.num_tokens[completion.index] = self.num_tokens.get(completion.index, 0) + len(completion.token_ids)
            if completion.finish_reason is not None:
                self.finish_reasons[completion.index] = completion.finish_reason
        if new_tokens:
            self.metrics.generation_tokens.inc(new_tokens)
            if self.first_token is None:
                self.first_token = now
                self.metrics.ttft.observe(now - self.arrival)
            self.last_token = now

    def finish(self, num_sequences: int, aborted: bool) -> None:
        for index in range(num_sequences):
            reason = self.finish_reasons.get(index, "abort")
            self.metrics.requests_finished.labels(reason).inc()
        if aborted or self.first_token is None or self.last_token is None:
            return
        self.metrics.e2e.observe(self.last_token - self.arrival)
        longest = max(self.num_tokens.values(), default=0)
        if longest > 1:
            self.metrics.tpot.observe((self.last_token - self.first_token) / (longest - 1))
