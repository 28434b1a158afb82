"""`WeightedHistogram`: a Prometheus histogram that takes several equal observations at once.

A streamed frame carries several tokens: each of them waited the frame's gap divided by their
number, and the inter-token latency histogram must count every one. prometheus_client's
`Histogram.observe` takes one value at a time (a locked bucket and sum increment each), which
the serving path would pay per token; this one adds `count` observations of one value in one
bucket increment. It is exported exactly as a `Histogram` is (`_bucket`, `_count`, `_sum`).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry


class WeightedHistogram(Collector):
    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        bounds = sorted(buckets)
        self._name, self._documentation = name, documentation
        self._bounds = bounds if bounds and bounds[-1] == math.inf else [*bounds, math.inf]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value`."""
        i = bisect.bisect_left(self._bounds, value)  # the first bound >= value (`le`)
        with self._lock:
            self._counts[i] += count
            self._sum += value * count

    def collect(self) -> Iterable[Metric]:
        yield self._family()

    def describe(self) -> Iterable[Metric]:
        yield self._family()

    def _family(self) -> HistogramMetricFamily:
        with self._lock:
            counts, total = list(self._counts), self._sum
        return HistogramMetricFamily(
            self._name,
            self._documentation,
            buckets=list(zip(map(_bound, self._bounds), _cumulative(counts), strict=True)),
            sum_value=total,
        )


def _bound(value: float) -> str:
    return "+Inf" if value == math.inf else repr(float(value))


def _cumulative(counts: Iterable[int]) -> Iterator[float]:
    total = 0
    for count in counts:
        total += count
        yield float(total)
