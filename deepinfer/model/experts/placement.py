"""Where the experts of a Mixture-of-Experts layer live across expert-parallel groups, and the
load balancer (EPLB) that re-places them from recent traffic.

A `Placement` gives each group the same number of expert slots. `balanced_placement` first gives
the hottest experts redundant replicas (one at a time, to the expert whose load per replica is
highest), then packs the replicas, heaviest first, each into the least loaded group with a free
slot that does not hold that expert yet (greedy list scheduling, heaviest first). A replicated
expert's tokens are split evenly among its replicas (`split_rows`: contiguous runs of its rows
sorted by expert). Pure Python, no torch: the placement is computed between steps on plain
per-expert counts. Groups spread over several machines are packed machine first
(`hierarchical_placement`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    groups: tuple[tuple[int, ...], ...]
    """`groups[g]`: the experts in group g's slots (each expert in at least one group)."""

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def replicas(self, num_experts: int) -> list[int]:
        """How many replicas each expert has."""
        counts = [0] * num_experts
        for group in self.groups:
            for expert in group:
                counts[expert] += 1
        return counts

    def group_loads(self, load: Sequence[float]) -> list[float]:
        """Each group's share of `load` (per expert), a replicated expert's split evenly."""
        replicas = self.replicas(len(load))
        return [sum(load[e] / replicas[e] for e in group) for group in self.groups]

    def imbalance(self, load: Sequence[float]) -> float:
        """The busiest group's load over the mean group's (1.0: perfectly even)."""
        loads = self.group_loads(load)
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class ExpertSlice:
    """Rows `[start, start + count)` of a step's pairs sorted by expert, all routed to
    `expert`: the share one group computes."""

    expert: int
    start: int
    count: int


def split_rows(placement: Placement, counts: Sequence[int]) -> list[list[ExpertSlice]]:
    """Each group's slices of a step whose pairs, sorted by expert, number `counts[e]` for
    expert e: an expert's rows split into contiguous, near-equal runs (the first ones one row
    longer), one per replica in group order. Groups with nothing to do get an empty list."""
    holders: list[list[int]] = [[] for _ in counts]
    for g, group in enumerate(placement.groups):
        for expert in group:
            holders[expert].append(g)
    slices: list[list[ExpertSlice]] = [[] for _ in placement.groups]
    start = 0
    for expert, n in enumerate(counts):
        replicas = holders[expert]
        if n and not replicas:
            raise ValueError(f"expert {expert} is in no group of the placement")
        per, extra = divmod(n, max(len(replicas), 1))
        for r, g in enumerate(replicas):
            size = per + (r < extra)
            if size:
                slices[g].append(ExpertSlice(expert, start, size))
                start += size
    return slices


@dataclass(frozen=True)
class ExpertParallelStats:
    """A snapshot for the metrics."""

    num_groups: int
    steps: int
    rebalances: int
    """Placements computed (every `eplb_interval` steps)."""
    swaps: int
    """Layers whose placement changed and was swapped in."""
    group_rows: tuple[int, ...]
    """(token, expert) rows each group computed since start."""
    replicas: dict[int, tuple[int, ...]]
    """Sparse layer -> replicas of each expert in its current placement."""
    failed_groups: tuple[int, ...] = ()
    """Groups out of service (a rank whose process is gone), their runs computed here."""


def static_placement(num_experts: int, num_groups: int) -> Placement:
    """Experts in contiguous blocks, no replicas: what expert parallelism does without EPLB."""
    _check(num_experts, num_groups, 0)
    per = num_experts // num_groups
    return Placement(tuple(tuple(range(g * per, (g + 1) * per)) for g in range(num_groups)))


def balanced_placement(load: Sequence[float], num_groups: int, redundant: int) -> Placement:
    """Replicas for the hottest experts (`redundant` extra slots in all), packed so that the
    groups carry equal load. Deterministic: ties go to the lower expert and group."""
    num_experts = len(load)
    _check(num_experts, num_groups, redundant)
    slots = (num_experts + redundant) // num_groups
    groups = _pack(_replica_items(load, redundant), num_groups, slots)
    return Placement(tuple(tuple(sorted(e for _, e in group)) for group in groups))


def hierarchical_placement(
    load: Sequence[float], num_nodes: int, groups_per_node: int, redundant: int
) -> Placement:
    """For groups that share machines (`groups_per_node` each, machine by machine): the replicas
    packed into machines first, so that machines carry equal load (their links are the slow
    ones), then each machine's into its own groups. One machine: `balanced_placement`."""
    num_experts, num_groups = len(load), num_nodes * groups_per_node
    _check(num_experts, num_groups, redundant)
    slots = (num_experts + redundant) // num_groups
    groups: list[tuple[int, ...]] = []
    for node in _pack(_replica_items(load, redundant), num_nodes, slots * groups_per_node):
        for group in _pack(node, groups_per_node, slots):
            groups.append(tuple(sorted(e for _, e in group)))
    return Placement(tuple(groups))


Item = tuple[float, int]
"""(load share, expert): one replica."""


def _replica_items(load: Sequence[float], redundant: int) -> list[Item]:
    """Every replica with its share of its expert's load, heaviest first."""
    replicas = _replicate(load, redundant)
    return sorted(
        ((load[e] / replicas[e], e) for e in range(len(load)) for _ in range(replicas[e])),
        key=lambda item: (-item[0], item[1]),
    )


def _pack(items: Sequence[Item], num_bins: int, slots: int) -> list[list[Item]]:
    """Items in order, each into the least loaded bin with a free slot that does not hold that
    expert yet (any bin with a free slot if all do)."""
    bins: list[list[Item]] = [[] for _ in range(num_bins)]
    totals = [0.0] * num_bins
    for share, expert in items:
        open_bins = [b for b in range(num_bins) if len(bins[b]) < slots]
        fresh = [b for b in open_bins if all(e != expert for _, e in bins[b])] or open_bins
        b = min(fresh, key=lambda b: (totals[b], b))
        bins[b].append((share, expert))
        totals[b] += share
    return bins


def _replicate(load: Sequence[float], redundant: int) -> list[int]:
    """Replicas per expert: one each, then each extra one to the highest load per replica."""
    replicas = [1] * len(load)
    heap = [(-float(w), e) for e, w in enumerate(load)]
    heapq.heapify(heap)
    for _ in range(redundant):
        _, e = heapq.heappop(heap)
        replicas[e] += 1
        heapq.heappush(heap, (-load[e] / replicas[e], e))
    return replicas


def _check(num_experts: int, num_groups: int, redundant: int) -> None:
    if num_groups < 1 or redundant < 0 or (num_experts + redundant) % num_groups:
        raise ValueError(
            f"{num_experts} experts and {redundant} redundant replicas do not fill "
            f"{num_groups} groups evenly"
        )
