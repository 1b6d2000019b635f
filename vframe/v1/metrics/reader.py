"""vLLM's ``vllm.v1.metrics.reader``: ``LLM.get_metrics()`` returns these.

Each Prometheus series of the engine becomes one ``Counter``, ``Gauge`` or
``Histogram`` (one per label set). The names are the server's ``/metrics``
names (``vframe:`` where vLLM writes ``vllm:``; counters without ``_total``,
as vLLM's reader gives them); docs/serving.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry


@dataclass
class Metric:
    """One series: its name and its ``key=value`` labels."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters (vLLM uses it for speculative decoding
    only; vframe reports none)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: ``buckets`` maps each upper bound (``le``, as a
    string, ``"+Inf"`` included) to the cumulative count; ``count`` equals the
    ``"+Inf"`` bucket's; ``sum`` is the sum of the observed values."""

    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(
    registry: CollectorRegistry, prefix: str = "vframe:", exclude: frozenset[str] = frozenset()
) -> list[Metric]:
    """The counters, gauges and histograms of ``registry`` whose names start with
    ``prefix`` (other types are skipped, as in vLLM), less the names in ``exclude``."""
    collected: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(prefix) or family.name in exclude:
            continue
        if family.type == "gauge":
            collected += [Gauge(family.name, dict(s.labels), s.value) for s in family.samples]
        elif family.type == "counter":
            total = family.name + "_total"
            collected += [Counter(family.name, dict(s.labels), int(s.value)) for s in family.samples if s.name == total]
        elif family.type == "histogram":
            collected += _histograms(family)
    return collected


def _histograms(family) -> list[Histogram]:
    by_labels: dict[frozenset[tuple[str, str]], Histogram] = {}

    def entry(labels: dict[str, str]) -> Histogram:
        key = frozenset(labels.items())
        if key not in by_labels:
            by_labels[key] = Histogram(family.name, labels, count=0, sum=0.0, buckets={})
        return by_labels[key]

    for s in family.samples:
        if s.name == family.name + "_bucket":
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            entry(labels).buckets[s.labels["le"]] = int(s.value)
        elif s.name == family.name + "_count":
            entry(dict(s.labels)).count = int(s.value)
        elif s.name == family.name + "_sum":
            entry(dict(s.labels)).sum = s.value
    return list(by_labels.values())
