"""Prometheus metrics in a per-app registry (never the process-global one), so several apps can
live in one process and tests can read exact values."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepinfer.api.ops.live_stats import LiveStats
from deepinfer.api.ops.weighted_histogram import WeightedHistogram
from deepinfer.api.ops.worker_metrics import worker_metrics
from deepinfer.api.protocol import EngineClient, OutputStream
from deepinfer.engine.types import EngineStats, GenerationOutput, Usage
from deepinfer.scheduler.admission import PrefillCounts
from deepinfer.scheduler.speculative import SpeculativeCounts
from deepinfer.tiers.stats import DiskTierStats, HostTierStats

_LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)


class _EngineCollector(Collector):
    """Gauges read from `engine.stats()` at scrape time (nothing to keep in sync)."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        if not self._engine.is_running:
            return
        stats = self._engine.stats()
        yield _gauge("deepinfer_num_requests_waiting", "Requests queued", stats.num_waiting)
        yield _gauge(
            "deepinfer_num_requests_running", "Requests holding KV blocks", stats.num_running
        )
        yield _gauge("deepinfer_kv_blocks_used", "KV blocks in use", stats.num_blocks_used)
        yield _gauge("deepinfer_kv_blocks_total", "KV blocks in the pool", stats.num_blocks_total)
        if stats.decode_blocks_total:
            yield _gauge(
                "deepinfer_decode_kv_blocks_used",
                "KV blocks in use in the decode device group's own pool",
                stats.decode_blocks_used,
            )
            yield _gauge(
                "deepinfer_decode_kv_blocks_total",
                "KV blocks in the decode device group's own pool",
                stats.decode_blocks_total,
            )
        if stats.window_blocks_total:
            yield _gauge(
                "deepinfer_window_kv_blocks_used",
                "KV blocks in requests' windows in the sliding-window layers' own pool",
                stats.window_blocks_used,
            )
            yield _gauge(
                "deepinfer_window_kv_blocks_total",
                "KV blocks in the sliding-window layers' own pool",
                stats.window_blocks_total,
            )
        yield CounterMetricFamily(
            "deepinfer_failed_steps",
            "Engine steps that raised (each failed only its own requests)",
            value=stats.num_failed_steps,
        )
        yield CounterMetricFamily(
            "deepinfer_failed_requests",
            "Requests ended with an internal error",
            value=stats.num_failed_requests,
        )
        yield from _prefill_metrics(stats.prefill_counts)
        yield from _speculative_metrics(stats.speculative)
        if stats.disk is not None:
            yield from _disk_metrics(stats.disk)
        if stats.host is not None:
            yield from _host_metrics(stats.host)
        yield from worker_metrics(stats)
        yield from _vllm_metrics(self._engine.model_name, stats)
        if stats.kv_events_dropped is not None:
            yield CounterMetricFamily(
                "deepinfer_kv_events_dropped",
                "KV events dropped because the publisher fell behind (routers miss them)",
                value=stats.kv_events_dropped,
            )


def _vllm_metrics(model_name: str, stats: EngineStats) -> Iterator[Metric]:
    """vLLM's names for the gauges that routers and autoscalers read (the Gateway API Inference
    Extension's endpoint picker, KEDA), with vLLM's labels: the same values as ours, the KV
    cache's as a 0..1 fraction of the fuller pool (with a separate decode pool, the fuller one)."""
    usage = stats.num_blocks_used / stats.num_blocks_total if stats.num_blocks_total else 0.0
    if stats.decode_blocks_total:
        usage = max(usage, stats.decode_blocks_used / stats.decode_blocks_total)
    for name, doc, value in (
        ("num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
        (
            "num_requests_running",
            "Number of requests in model execution batches.",
            stats.num_running,
        ),
        ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
        (
            "gpu_cache_usage_perc",
            "KV-cache usage (the older name). 1 means 100 percent usage.",
            usage,
        ),
    ):
        family = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name", "engine"])
        family.add_metric([model_name, "0"], value)
        yield family


def _prefill_metrics(c: PrefillCounts) -> Iterator[Metric]:
    """Prompt work: tokens computed, and tokens a shared prefix in flight saved."""
    yield CounterMetricFamily(
        "deepinfer_prefill_computed_tokens",
        "Prompt tokens computed by prefill (recomputation after preemption included)",
        value=c.num_computed_tokens,
    )
    yield CounterMetricFamily(
        "deepinfer_prefill_inflight_saved_tokens",
        "Prompt tokens hit after waiting for another request to compute them",
        value=c.num_inflight_saved_tokens,
    )
    yield CounterMetricFamily(
        "deepinfer_prefill_inflight_waits",
        "Requests that waited for a shared prefix being computed for another request",
        value=c.num_inflight_waits,
    )


def _speculative_metrics(c: SpeculativeCounts) -> Iterator[Metric]:
    """Speculative decoding, by proposer: drafts verified and accepted, and in how many
    request-steps (mean accepted run = accepted / verified)."""
    for name, doc, value in (
        ("drafted", "Draft tokens verified", c.num_drafted),
        ("accepted", "Draft tokens the model agreed with", c.num_accepted),
        ("verified", "Request-steps that verified drafts", c.num_verified),
    ):
        family = CounterMetricFamily(f"deepinfer_speculative_{name}", doc, labels=["proposer"])
        family.add_metric([c.proposer], value)
        yield family
    mean = GaugeMetricFamily(
        "deepinfer_speculative_mean_accepted_length",
        "Draft tokens accepted per request-step that verified drafts",
        labels=["proposer"],
    )
    mean.add_metric([c.proposer], c.mean_accepted_length)
    yield mean
    yield from _calibration_metrics(c)


def _calibration_metrics(c: SpeculativeCounts) -> Iterator[Metric]:
    """The gate's calibration by bucket of predicted acceptance (`bucket`: its lower edge):
    positions observed, the sum of their predictions, and how many were accepted."""
    for name, doc, values in (
        ("trials", "Draft positions observed", [b.num_trials for b in c.calibration]),
        ("predicted", "Sum of the predicted acceptance", [b.predicted for b in c.calibration]),
        ("accepted", "Draft positions accepted", [b.accepted for b in c.calibration]),
    ):
        family = CounterMetricFamily(
            f"deepinfer_speculative_gate_{name}", doc, labels=["proposer", "bucket"]
        )
        for b, value in zip(c.calibration, values, strict=True):
            family.add_metric([c.proposer, f"{b.lower:.1f}"], value)
        yield family


def _disk_metrics(d: DiskTierStats) -> Iterator[Metric]:
    """The disk tier's own counters (monotonic since start) and sizes."""
    for name, doc, value in (
        ("lookups", "Blocks looked up on disk", d.num_lookups),
        ("hits", "Blocks loaded from disk", d.num_hits),
        ("writes", "Blocks written to disk", d.num_writes),
        ("writes_dropped", "Block writes dropped (queue full, degraded)", d.num_writes_dropped),
        ("evictions", "Blocks evicted by the byte budget", d.num_evictions),
        ("expirations", "Blocks dropped at the end of their retention", d.num_expirations),
        ("checksum_failures", "Corrupt records detected and dropped", d.num_checksum_failures),
        ("corrupt_records", "Index records that failed to decode (dropped)", d.num_corrupt_records),
        ("index_repairs", "Index rebuilds, and damaged indexes set aside", d.num_index_repairs),
        ("io_errors", "Disk I/O errors (the tier degrades, serving goes on)", d.num_io_errors),
    ):
        yield CounterMetricFamily(f"deepinfer_disk_cache_{name}", doc, value=value)
    yield _gauge("deepinfer_disk_cache_blocks", "Blocks indexed on disk", d.num_blocks)
    yield _gauge("deepinfer_disk_cache_bytes", "Bytes of segment files on disk", d.disk_bytes)
    yield _gauge("deepinfer_disk_cache_degraded", "1 while the disk tier is degraded", d.degraded)


def _host_metrics(h: HostTierStats) -> Iterator[Metric]:
    """The host-RAM tier's own counters (monotonic since start) and sizes."""
    for name, doc, value in (
        ("lookups", "Blocks looked up in host memory", h.num_lookups),
        ("hits", "Blocks loaded from host memory", h.num_hits),
        ("offers", "Blocks stored in host memory", h.num_offers),
        ("offers_dropped", "Blocks not stored (every slot in use)", h.num_offers_dropped),
        ("evictions", "Blocks evicted by the byte budget (LRU)", h.num_evictions),
    ):
        yield CounterMetricFamily(f"deepinfer_host_cache_{name}", doc, value=value)
    yield _gauge("deepinfer_host_cache_blocks", "Blocks held in host memory", h.num_blocks)
    yield _gauge("deepinfer_host_cache_bytes", "Bytes of blocks held in host memory", h.num_bytes)
    yield _gauge(
        "deepinfer_host_cache_capacity_bytes", "Byte budget of the host tier", h.capacity_bytes
    )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class ApiMetrics:
    """Request, token and latency metrics of one app."""

    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "deepinfer_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "deepinfer_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache, by tier",
            ["tier"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "deepinfer_generation_tokens", "Generated tokens", registry=r
        )
        self.ttft = Histogram(
            "deepinfer_time_to_first_token_seconds", "Time from arrival to first output token",
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.itl = WeightedHistogram(
            "deepinfer_inter_token_latency_seconds", "Time between output tokens",
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "deepinfer_request_latency_seconds", "Time from arrival to last output token",
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.step_time = Histogram(
            "deepinfer_engine_step_seconds", "Duration of one engine step (forward + sampling)",
            ["worker"], buckets=_STEP_BUCKETS_S, registry=r,
        )  # fmt: skip
        r.register(_EngineCollector(engine))
        self.live = LiveStats()
        """Totals and recent samples for `GET /v1/stats`."""

    def observe_step(self, elapsed_s: float, worker: str = "mixed") -> None:
        """Hook for the engine: call once per step with its duration and worker."""
        self.step_time.labels(worker=worker).observe(elapsed_s)
        self.live.on_step(worker, elapsed_s)

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, stream: OutputStream, arrival_s: float) -> OutputStream:
        """The same stream, timed: TTFT, inter-token latency, and token counts when it ends
        (finished or not: a disconnect still counts what was generated)."""
        return _TrackedStream(self, stream, arrival_s)


class _TrackedStream:
    def __init__(self, metrics: ApiMetrics, stream: OutputStream, arrival_s: float) -> None:
        self._metrics = metrics
        self._stream = stream
        self._arrival_s = arrival_s
        self._iter: AsyncGenerator[GenerationOutput, None] | None = None

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return self._stream.num_prompt_tokens

    def __aiter__(self) -> AsyncIterator[GenerationOutput]:
        assert self._iter is None, "a stream is read once"
        self._iter = self._timed()
        return self._iter

    async def aclose(self) -> None:
        try:
            if self._iter is not None:
                await self._iter.aclose()
        finally:
            await self._stream.aclose()

    async def _timed(self) -> AsyncGenerator[GenerationOutput, None]:
        m, arrival_s = self._metrics, self._arrival_s
        live = m.live
        last_s = arrival_s
        usage: Usage | None = None
        try:
            async for out in self._stream:
                now = time.monotonic()
                if usage is None:
                    live.on_prompt(out.usage)
                if out.token_ids:
                    if last_s == arrival_s:
                        m.ttft.observe(now - arrival_s)
                        live.on_first_tokens(len(out.token_ids), now - arrival_s)
                    else:
                        gap = (now - last_s) / len(out.token_ids)
                        m.itl.observe(gap, len(out.token_ids))
                        live.on_tokens(len(out.token_ids), gap)
                    last_s = now
                usage = out.usage
                yield out
            m.e2e.observe(time.monotonic() - arrival_s)
        finally:
            if usage is not None:
                m.prompt_tokens.inc(usage.prompt_tokens)
                m.cached_tokens.labels("device").inc(usage.device_cached_tokens)
                m.cached_tokens.labels("host").inc(usage.host_cached_tokens)
                m.cached_tokens.labels("disk").inc(usage.disk_cached_tokens)
                m.cached_tokens.labels("remote").inc(usage.remote_cached_tokens)
                m.generation_tokens.inc(usage.completion_tokens)
