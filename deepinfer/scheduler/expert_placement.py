"""Where the experts of a Mixture-of-Experts layer live across expert-parallel groups, and the
load balancer (EPLB) that re-places them from recent traffic.

A `Placement` gives each group the same number of expert slots. `balanced_placement` first gives
the hottest experts redundant replicas (one at a time, to the expert whose load per replica is
highest), then packs the replicas, heaviest first, each into the least loaded group with a free
slot that does not hold that expert yet (greedy list scheduling, heaviest first). A replicated
expert's tokens are split evenly among its replicas. Pure Python: the scheduler never imports
torch. (One level: groups are not told apart by node; a hierarchical policy would pack nodes
first.)
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
    replicas = _replicate(load, redundant)
    items = sorted(
        ((load[e] / replicas[e], e) for e in range(num_experts) for _ in range(replicas[e])),
        key=lambda item: (-item[0], item[1]),
    )
    slots = (num_experts + redundant) // num_groups
    groups: list[list[int]] = [[] for _ in range(num_groups)]
    totals = [0.0] * num_groups
    for share, expert in items:
        open_groups = [g for g in range(num_groups) if len(groups[g]) < slots]
        fresh = [g for g in open_groups if expert not in groups[g]] or open_groups
        g = min(fresh, key=lambda g: (totals[g], g))
        groups[g].append(expert)
        totals[g] += share
    return Placement(tuple(tuple(sorted(group)) for group in groups))


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
