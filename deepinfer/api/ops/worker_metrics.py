"""Per-worker and prefill-planner gauges, read from `EngineStats` at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from deepinfer.engine.types import EngineStats, HandoffStats, WorkerStats
from deepinfer.kv_transfer.stats import KVTransferStats
from deepinfer.model.experts.placement import ExpertParallelStats
from deepinfer.scheduler.prefill_types import PlannerStats


def worker_metrics(stats: EngineStats) -> Iterator[Metric]:
    if stats.workers:
        yield from _workers(stats.workers)
    if stats.prefill is not None:
        yield from _planner(stats.prefill)
    if stats.decode_blocks_total:
        yield from _handoffs(stats.handoffs)
    if stats.expert_load:
        yield _expert_load(stats.expert_load)
    if stats.expert_parallel is not None:
        yield from _expert_parallel(stats.expert_parallel)
    if stats.kv_transfer is not None:
        yield from _kv_transfer(stats.kv_transfer)


def _kv_transfer(t: KVTransferStats) -> Iterator[Metric]:
    """KV transfers with other replicas: pulls as a consumer, holds as a producer."""
    for name, doc, value in (
        ("deepinfer_kv_transfer_pulls", "Requests whose prompt blocks were to be pulled", t.num_pulls),
        ("deepinfer_kv_transfer_pulled_blocks", "KV blocks pulled from producers", t.num_pulled_blocks),
        ("deepinfer_kv_transfer_pull_seconds", "Time pulls that read blocks took", t.pull_seconds),
        ("deepinfer_kv_transfer_local_blocks", "Blocks a pull skipped: cached here already", t.num_local_blocks),
        ("deepinfer_kv_transfer_failed_pulls", "Pulls that registered nothing (computed here)", t.num_failed_pulls),
        ("deepinfer_kv_transfer_released_holds", "Holds released by their consumer", t.num_released),
        ("deepinfer_kv_transfer_expired_holds", "Holds no consumer released in time", t.num_expired),
    ):  # fmt: skip
        yield CounterMetricFamily(name, doc, value=value)
    yield GaugeMetricFamily(
        "deepinfer_kv_transfer_held_blocks", "Blocks kept for consumers now", t.num_held_blocks
    )
    yield GaugeMetricFamily(
        "deepinfer_kv_transfer_quarantined_blocks",
        "Blocks set aside after a read that could not be stopped",
        t.num_quarantined_blocks,
    )


def _expert_load(load: tuple[tuple[int, ...], ...]) -> Metric:
    """Mixture of Experts: what each expert of each sparse layer was given."""
    family = CounterMetricFamily(
        "deepinfer_moe_expert_tokens",
        "Tokens routed to each expert (a token counts once per expert it is routed to)",
        labels=["layer", "expert"],
    )
    for layer, counts in enumerate(load):
        for expert, n in enumerate(counts):
            family.add_metric([str(layer), str(expert)], n)
    return family


def _expert_parallel(ep: ExpertParallelStats) -> Iterator[Metric]:
    """Expert parallelism: the groups' shares and the balancer's placements."""
    yield GaugeMetricFamily("deepinfer_moe_expert_groups", "Expert-parallel groups", ep.num_groups)
    yield GaugeMetricFamily(
        "deepinfer_moe_failed_groups",
        "Expert-parallel groups out of service (their experts computed by the serving process)",
        len(ep.failed_groups),
    )
    for name, doc, value in (
        ("deepinfer_moe_eplb_rebalances", "Expert placements computed from recent load", ep.rebalances),
        ("deepinfer_moe_placement_swaps", "Sparse layers whose experts were re-placed", ep.swaps),
    ):  # fmt: skip
        yield CounterMetricFamily(name, doc, value=value)
    rows = CounterMetricFamily(
        "deepinfer_moe_group_rows",
        "(token, expert) rows each expert-parallel group computed",
        labels=["group"],
    )
    for group, n in enumerate(ep.group_rows):
        rows.add_metric([str(group)], n)
    yield rows
    replicas = GaugeMetricFamily(
        "deepinfer_moe_expert_replicas",
        "Replicas of each expert in its layer's current placement",
        labels=["layer", "expert"],
    )
    for layer, counts in ep.replicas.items():
        for expert, n in enumerate(counts):
            replicas.add_metric([str(layer), str(expert)], n)
    yield replicas


def _handoffs(h: HandoffStats) -> Iterator[Metric]:
    """KV copies between the two device groups' pools."""
    for name, doc, value in (
        ("deepinfer_kv_handoffs", "KV copies from the prefill pool to the decode pool", h.num_handoffs),
        ("deepinfer_kv_handoff_blocks", "KV blocks copied to the decode pool", h.num_blocks),
        ("deepinfer_kv_handoff_seconds", "Time KV copies took, start to completion", h.seconds_total),
    ):  # fmt: skip
        yield CounterMetricFamily(name, doc, value=value)


def _workers(workers: tuple[WorkerStats, ...]) -> Iterator[Metric]:
    busy = GaugeMetricFamily(
        "deepinfer_worker_busy_fraction",
        "Share of the last 10 s the worker spent running steps",
        labels=["worker"],
    )
    busy_s = CounterMetricFamily(
        "deepinfer_worker_busy_seconds", "Time the worker spent running steps", labels=["worker"]
    )
    steps = CounterMetricFamily("deepinfer_worker_steps", "Steps run", labels=["worker"])
    threads = GaugeMetricFamily(
        "deepinfer_worker_threads", "CPU threads of the worker (0: not CPU)", labels=["worker"]
    )
    for w in workers:
        busy.add_metric([w.name], w.busy_fraction)
        busy_s.add_metric([w.name], w.busy_s_total)
        steps.add_metric([w.name], w.num_steps)
        threads.add_metric([w.name], w.num_threads or 0)
    yield from (busy, busy_s, steps, threads)


def _planner(p: PlannerStats) -> Iterator[Metric]:
    depth = GaugeMetricFamily(
        "deepinfer_prefill_queue_depth", "Requests queued for prefill", labels=["bucket"]
    )
    tokens = GaugeMetricFamily(
        "deepinfer_prefill_queued_tokens", "Prompt tokens still to prefill", labels=["bucket"]
    )
    for label, n, t in zip(p.bucket_labels, p.queue_depths, p.queued_tokens, strict=True):
        depth.add_metric([label], n)
        tokens.add_metric([label], t)
    yield from (depth, tokens)
    for name, doc, value in (
        ("predicted", "Predicted duration of the last prefill step", p.last_predicted_s),
        ("measured", "Measured duration of the last prefill step", p.last_measured_s),
    ):
        yield GaugeMetricFamily(f"deepinfer_prefill_step_{name}_seconds", doc, value=value)
    yield GaugeMetricFamily(
        "deepinfer_prefill_cost_model_error",
        "Mean |predicted - measured| / measured prefill step time",
        value=p.mean_abs_rel_error,
    )
    yield CounterMetricFamily(
        "deepinfer_prefill_steps_over_budget",
        "Prefill steps that took 20% longer than their time budget",
        value=p.num_steps_over_budget,
    )
