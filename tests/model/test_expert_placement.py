"""Expert placement and the load balancer: every expert placed, equal slots per group, no expert
twice in a group, replicas to the hottest experts, and skewed (Zipf) loads balanced to within 15%
of the mean group where a static placement is far off."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.model.experts.placement import (
    Placement,
    balanced_placement,
    hierarchical_placement,
    split_rows,
    static_placement,
)


def _zipf(num_experts: int, s: float = 1.2) -> list[float]:
    return [1.0 / (rank + 1) ** s for rank in range(num_experts)]


def _check_shape(p: Placement, num_experts: int, num_groups: int, redundant: int) -> None:
    slots = (num_experts + redundant) // num_groups
    assert p.num_groups == num_groups and all(len(g) == slots for g in p.groups)
    replicas = p.replicas(num_experts)
    assert min(replicas) >= 1 and sum(replicas) == num_experts + redundant
    if max(replicas) <= num_groups:
        assert all(len(set(g)) == len(g) for g in p.groups)


@given(
    st.integers(1, 8).flatmap(
        lambda groups: st.tuples(
            st.just(groups),
            st.integers(1, 6).map(lambda k: k * groups),  # experts
            st.integers(0, 3).map(lambda k: k * groups),  # redundant
        )
    ),
    st.data(),
)
def test_placements_are_well_formed(shape: tuple[int, int, int], data: st.DataObject) -> None:
    groups, experts, redundant = shape
    load = data.draw(st.lists(st.integers(0, 1000), min_size=experts, max_size=experts))
    p = balanced_placement(load, groups, redundant)
    _check_shape(p, experts, groups, redundant)
    assert sum(p.group_loads(load)) == pytest.approx(sum(load))
    # the extra replicas went to the experts with the most load per replica
    replicas = p.replicas(experts)
    if redundant and sum(load):
        least_served = max(load[e] / replicas[e] for e in range(experts))
        assert all(load[e] / (replicas[e] - 1) >= least_served - 1e-9
                   for e in range(experts) if replicas[e] > 1)  # fmt: skip
    _check_shape(static_placement(experts, groups), experts, groups, 0)


def test_zipf_load_is_balanced() -> None:
    load = _zipf(64)
    static = static_placement(64, 4)
    balanced = balanced_placement(load, 4, redundant=8)
    assert static.imbalance(load) > 2.0  # the hot experts all in group 0
    assert balanced.imbalance(load) <= 1.15
    assert balanced.replicas(64)[0] > 1  # the hottest expert replicated
    assert balanced_placement(load, 4, redundant=0).imbalance(load) > balanced.imbalance(load)


def test_uneven_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fill"):
        balanced_placement([1.0] * 10, 4, redundant=1)


def test_machines_are_packed_first() -> None:
    """Two machines of two groups: each machine carries half the load, and so does each group;
    on one machine the policy is the flat one."""
    load = _zipf(64)
    p = hierarchical_placement(load, num_nodes=2, groups_per_node=2, redundant=8)
    _check_shape(p, 64, 4, 8)
    groups = p.group_loads(load)
    machines = [groups[0] + groups[1], groups[2] + groups[3]]
    assert max(machines) / (sum(machines) / 2) <= 1.05
    assert p.imbalance(load) <= 1.15
    assert hierarchical_placement(load, 1, 4, 8) == balanced_placement(load, 4, 8)


@given(
    st.integers(1, 4).flatmap(
        lambda groups: st.tuples(
            st.just(groups),
            st.integers(1, 4).map(lambda k: k * groups),  # experts
            st.integers(0, 2).map(lambda k: k * groups),  # redundant
        )
    ),
    st.data(),
)
def test_rows_split_among_replicas(shape: tuple[int, int, int], data: st.DataObject) -> None:
    """Every sorted row goes to exactly one group holding its expert; an expert's rows are split
    into contiguous runs whose sizes differ by at most one."""
    groups, experts, redundant = shape
    load = data.draw(st.lists(st.integers(0, 50), min_size=experts, max_size=experts))
    counts = data.draw(st.lists(st.integers(0, 30), min_size=experts, max_size=experts))
    p = balanced_placement(load, groups, redundant)
    slices = split_rows(p, counts)
    assert len(slices) == groups
    owner = [-1] * sum(counts)
    runs: dict[int, list[int]] = {}
    for g, mine in enumerate(slices):
        for s in mine:
            assert s.expert in p.groups[g] and s.count > 0
            for row in range(s.start, s.start + s.count):
                assert owner[row] == -1
                owner[row] = s.expert
            runs.setdefault(s.expert, []).append(s.count)
    want = [e for e, n in enumerate(counts) for _ in range(n)]  # rows sorted by expert
    assert owner == want
    for e, sizes in runs.items():
        assert sum(sizes) == counts[e] and max(sizes) - min(sizes) <= 1
        assert len(sizes) <= p.replicas(experts)[e]
