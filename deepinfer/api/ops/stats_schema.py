"""`GET /v1/stats`: one JSON snapshot of the server for scripts and the dashboard.

Counters (`tokens`, `disk.hits`...) are totals since the server started: a reader takes the
difference of two snapshots over their `time_s` for a rate. A number not measured yet is null. Latency percentiles are over the
last `latency.window_s` seconds. Durations are in milliseconds, times in Unix seconds.
"""

from __future__ import annotations

import msgspec


class Percentiles(msgspec.Struct):
    count: int
    """Samples in the window (a TTFT per request, an inter-token gap per token)."""
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None


class Latency(msgspec.Struct):
    window_s: float
    ttft: Percentiles
    itl: Percentiles


class WorkerInfo(msgspec.Struct):
    name: str
    """`prefill` and `decode` (disaggregated), or `mixed` (colocated)."""
    device: str
    threads: int | None
    busy_fraction: float
    """Share of the last 10 s the worker spent running steps."""
    steps: int
    step_ms: float | None
    """Mean measured step time over the last `latency.window_s` seconds (None: no step)."""
    last_step_ms: float | None
    predicted_step_ms: float | None
    """What the cost model predicted for the last step (the prefill planner's; else None)."""


class PrefillBucket(msgspec.Struct):
    label: str
    """Prompt lengths of the bucket, e.g. `<=512`."""
    requests: int
    tokens: int
    """Prompt tokens still to compute."""


class PrefillPlanner(msgspec.Struct):
    buckets: list[PrefillBucket]
    predicted_ms: float | None
    measured_ms: float | None
    """The last step's predicted and measured duration (None before the first step)."""
    cost_model_error: float | None
    """Mean |predicted - measured| / measured (None before the first step)."""
    steps_over_budget: int


class KvPool(msgspec.Struct):
    blocks_used: int
    blocks_total: int
    decode_blocks_used: int
    decode_blocks_total: int
    """The decode device group's own pool (0 when one pool serves both workers)."""


class TokenCounts(msgspec.Struct):
    """Totals since start. Prompt and cached tokens are counted when a request's first output
    arrives, generated tokens as they stream."""

    prompt: int
    generated: int
    computed: int
    """Prompt tokens computed by prefill (recomputation included)."""
    cached_device: int
    cached_host: int
    cached_disk: int


class RetentionClass(msgspec.Struct):
    name: str
    """`agent` or `chat`."""
    retention_s: float
    """How long a block of the class is kept after its last use."""
    blocks: int
    tokens: int
    bytes: int
    next_expiry_s: float | None
    """When the class's first block to expire does so (None: the class holds none)."""
    last_expiry_s: float | None
    """When the class's last block to expire does so (in the future, like `next_expiry_s`)."""


class DiskInfo(msgspec.Struct):
    bytes: int
    """Bytes of segment files."""
    live_bytes: int
    max_bytes: int
    blocks: int
    segments: int
    pending_bytes: int
    lookups: int
    hits: int
    writes: int
    evictions: int
    expirations: int
    degraded: bool
    classes: list[RetentionClass]
    """Per retention class (read from the index at most every few seconds)."""


class HostInfo(msgspec.Struct):
    blocks: int
    bytes: int
    capacity_bytes: int
    lookups: int
    hits: int


class Stats(msgspec.Struct):
    time_s: float
    uptime_s: float
    model: str
    running: int
    waiting: int
    kv: KvPool
    workers: list[WorkerInfo]
    prefill: PrefillPlanner | None
    """The prefill planner (disaggregated mode; None when colocated)."""
    tokens: TokenCounts
    latency: Latency
    disk: DiskInfo | None
    host: HostInfo | None
    failed_steps: int
    failed_requests: int
