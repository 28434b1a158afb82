"""`snapshot(ctx, disk_summary)`: the `Stats` record of `GET /v1/stats`, from the engine's stats,
the API's live totals and the disk tier's summary."""

from __future__ import annotations

import math
import time

from deepinfer.api.context import ApiContext
from deepinfer.api.ops.live_stats import LiveStats
from deepinfer.api.ops.stats_schema import (
    DiskInfo,
    HostInfo,
    KvPool,
    Latency,
    PrefillBucket,
    PrefillPlanner,
    RetentionClass,
    Stats,
    WorkerInfo,
)
from deepinfer.engine.types import EngineStats
from deepinfer.scheduler.prefill_types import PlannerStats
from deepinfer.tiers.stats import DiskSummary, DiskTierStats, HostTierStats


def snapshot(ctx: ApiContext, disk_summary: DiskSummary | None) -> Stats:
    s = ctx.engine.stats()
    live = ctx.metrics.live
    return Stats(
        time_s=time.time(),
        uptime_s=live.uptime_s(),
        model=ctx.model_name,
        running=s.num_running,
        waiting=s.num_waiting,
        kv=KvPool(
            blocks_used=s.num_blocks_used,
            blocks_total=s.num_blocks_total,
            decode_blocks_used=s.decode_blocks_used,
            decode_blocks_total=s.decode_blocks_total,
        ),
        workers=_workers(s, live),
        prefill=_planner(s.prefill) if s.prefill is not None else None,
        tokens=live.tokens(computed=s.prefill_counts.num_computed_tokens),
        latency=Latency(window_s=live.window_s, ttft=live.ttft(), itl=live.itl()),
        disk=_disk(s.disk, disk_summary) if s.disk is not None else None,
        host=_host(s.host) if s.host is not None else None,
        failed_steps=s.num_failed_steps,
        failed_requests=s.num_failed_requests,
    )


def _workers(s: EngineStats, live: LiveStats) -> list[WorkerInfo]:
    out = []
    for w in s.workers:
        mean_ms, last_ms = live.step_ms(w.name)
        predicted_ms = None
        if w.name == "prefill" and s.prefill is not None:
            predicted_ms = _ms(s.prefill.last_predicted_s)
        out.append(
            WorkerInfo(
                name=w.name,
                device=w.device,
                threads=w.num_threads,
                busy_fraction=w.busy_fraction,
                steps=w.num_steps,
                step_ms=mean_ms,
                last_step_ms=last_ms,
                predicted_step_ms=predicted_ms,
            )
        )
    return out


def _planner(p: PlannerStats) -> PrefillPlanner:
    buckets = [
        PrefillBucket(label=label, requests=n, tokens=t)
        for label, n, t in zip(p.bucket_labels, p.queue_depths, p.queued_tokens, strict=True)
    ]
    return PrefillPlanner(
        buckets=buckets, predicted_ms=_ms(p.last_predicted_s),
        measured_ms=_ms(p.last_measured_s), cost_model_error=_finite(p.mean_abs_rel_error),
        steps_over_budget=p.num_steps_over_budget,
    )  # fmt: skip


def _disk(d: DiskTierStats, summary: DiskSummary | None) -> DiskInfo:
    classes = [
        RetentionClass(
            name=c.name,
            retention_s=c.retention_s,
            blocks=c.num_blocks,
            tokens=c.num_tokens,
            bytes=c.num_bytes,
            next_expiry_s=c.next_expiry_s,
            last_expiry_s=c.last_expiry_s,
        )
        for c in (summary.classes if summary is not None else ())
    ]
    return DiskInfo(
        bytes=d.disk_bytes, live_bytes=d.live_bytes,
        max_bytes=summary.max_bytes if summary is not None else 0,
        blocks=d.num_blocks, segments=summary.num_segments if summary is not None else 0,
        pending_bytes=d.pending_bytes, lookups=d.num_lookups, hits=d.num_hits,
        writes=d.num_writes, evictions=d.num_evictions, expirations=d.num_expirations,
        degraded=d.degraded, classes=classes,
    )  # fmt: skip


def _host(h: HostTierStats) -> HostInfo:
    return HostInfo(
        blocks=h.num_blocks, bytes=h.num_bytes, capacity_bytes=h.capacity_bytes,
        lookups=h.num_lookups, hits=h.num_hits,
    )  # fmt: skip


def _finite(value: float) -> float | None:
    """None for what was not measured yet (NaN)."""
    return value if math.isfinite(value) else None


def _ms(seconds: float) -> float | None:
    return 1e3 * seconds if math.isfinite(seconds) else None
