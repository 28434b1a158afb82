"""`LiveStats`: running totals and recent samples behind `GET /v1/stats`, kept as plain numbers.

What a stream reports costs a few additions a frame (tokens) or a request (TTFT, prompt and
cached tokens), and what a step reports one append; percentiles and means are computed only
when a snapshot is asked for, over the samples of the last `window_s` seconds.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterable

from deepinfer.api.ops.stats_schema import Percentiles, TokenCounts
from deepinfer.engine.types import Usage

WINDOW_S = 60.0
_MAX_SAMPLES = 8192
"""Most samples kept per series (the oldest go first when a window holds more)."""


class LiveStats:
    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self.started_s = clock()
        self.prompt_tokens = self.generated_tokens = 0
        self.cached_device = self.cached_host = self.cached_disk = 0
        self._ttft: deque[tuple[float, float]] = deque(maxlen=_MAX_SAMPLES)
        self._itl: deque[tuple[float, float, int]] = deque(maxlen=_MAX_SAMPLES)
        """(when, gap between tokens, how many tokens arrived with that gap)"""
        self._steps: dict[str, deque[tuple[float, float]]] = {}

    # -- recording (hot paths: keep them to a few operations)

    def on_prompt(self, usage: Usage) -> None:
        """A request's first output: its prompt and cached tokens."""
        self.prompt_tokens += usage.prompt_tokens
        self.cached_device += usage.device_cached_tokens
        self.cached_host += usage.host_cached_tokens
        self.cached_disk += usage.disk_cached_tokens

    def on_first_tokens(self, num_tokens: int, ttft_s: float) -> None:
        """A request's first output with tokens, `ttft_s` after its arrival."""
        self.generated_tokens += num_tokens
        self._ttft.append((self._clock(), ttft_s))

    def on_tokens(self, num_tokens: int, gap_s: float) -> None:
        """Tokens streamed in one later output, `gap_s` apart."""
        self.generated_tokens += num_tokens
        self._itl.append((self._clock(), gap_s, num_tokens))

    def on_step(self, worker: str, elapsed_s: float) -> None:
        steps = self._steps.get(worker)
        if steps is None:
            steps = self._steps[worker] = deque(maxlen=_MAX_SAMPLES)
        steps.append((self._clock(), elapsed_s))

    # -- reading

    def uptime_s(self) -> float:
        return self._clock() - self.started_s

    def tokens(self, computed: int) -> TokenCounts:
        return TokenCounts(
            prompt=self.prompt_tokens, generated=self.generated_tokens, computed=computed,
            cached_device=self.cached_device, cached_host=self.cached_host,
            cached_disk=self.cached_disk,
        )  # fmt: skip

    def ttft(self) -> Percentiles:
        since = self._clock() - self.window_s
        return percentiles((value, 1) for when, value in self._ttft if when >= since)

    def itl(self) -> Percentiles:
        since = self._clock() - self.window_s
        return percentiles((gap, n) for when, gap, n in self._itl if when >= since)

    def step_ms(self, worker: str) -> tuple[float | None, float | None]:
        """(mean over the window, last) step time of `worker` in ms; None where it ran none."""
        steps = self._steps.get(worker)
        if not steps:
            return None, None
        since = self._clock() - self.window_s
        recent = [elapsed for when, elapsed in steps if when >= since]
        mean = 1e3 * sum(recent) / len(recent) if recent else None
        return mean, 1e3 * steps[-1][1]


def percentiles(samples: Iterable[tuple[float, int]]) -> Percentiles:
    """p50/p90/p99 in ms of weighted samples (value in seconds, weight): the smallest value whose
    cumulative weight reaches the quantile (a value observed `n` times counts `n` times)."""
    ordered = sorted(samples)
    if not ordered:
        return Percentiles(count=0, p50_ms=None, p90_ms=None, p99_ms=None)
    cumulative: list[int] = []
    total = 0
    for _, weight in ordered:
        total += weight
        cumulative.append(total)

    def at(q: float) -> float:
        i = bisect.bisect_left(cumulative, q * total)
        return 1e3 * ordered[min(i, len(ordered) - 1)][0]

    return Percentiles(count=total, p50_ms=at(0.5), p90_ms=at(0.9), p99_ms=at(0.99))
