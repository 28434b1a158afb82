"""`LengthBuckets` and `BucketQueues`: bucket assignment by uncached tokens, FIFO queues."""

from __future__ import annotations

import pytest

from deepinfer.errors import ConfigError
from deepinfer.request import Request, SamplingParams
from deepinfer.scheduler.buckets import BucketQueues, LengthBuckets, PrefillEntry
from deepinfer.scheduler.cost_model import StepCostModel
from deepinfer.scheduler.prefill_planner import PrefillPlanner
from deepinfer.scheduler.prefill_types import PrefillPlannerConfig, PrefillView


def _reference_bucket(boundaries: tuple[int, ...], n: int) -> int:
    """The spec: the first bucket whose upper bound (inclusive) holds n; else the last."""
    for i, bound in enumerate(boundaries):
        if n <= bound:
            return i
    return len(boundaries)


@pytest.mark.parametrize(
    ("n", "bucket"),
    [(1, 0), (511, 0), (512, 0), (513, 1), (4096, 1), (4097, 2), (32768, 2), (32769, 3)],
)
def test_default_boundaries(n: int, bucket: int) -> None:
    assert LengthBuckets().index(n) == bucket


@pytest.mark.parametrize("boundaries", [(512, 4096, 32768), (8,), (100, 200, 300, 400, 1000)])
def test_index_matches_the_spec_everywhere(boundaries: tuple[int, ...]) -> None:
    buckets = LengthBuckets(boundaries)
    assert buckets.num_buckets == len(boundaries) + 1
    probes = {1, 2} | {b + d for b in boundaries for d in (-1, 0, 1)} | {10 * boundaries[-1]}
    for n in sorted(p for p in probes if p >= 1):
        assert buckets.index(n) == _reference_bucket(boundaries, n), n


def test_labels() -> None:
    buckets = LengthBuckets()
    labels = [buckets.label(i) for i in range(4)]
    assert labels == ["<=512", "<=4096", "<=32768", ">32768"]


@pytest.mark.parametrize("boundaries", [(), (0, 10), (10, 10), (100, 50)])
def test_bad_boundaries(boundaries: tuple[int, ...]) -> None:
    with pytest.raises(ConfigError):
        LengthBuckets(boundaries)


def test_queues_are_fifo_per_bucket() -> None:
    queues = BucketQueues(2)
    entries = [PrefillEntry(f"r{i}", 100, 0, i % 2, added_step=0) for i in range(6)]
    for e in entries:
        queues.push(e)
        queues.check_integrity()
    assert [e.request_id for e in queues.bucket(0)] == ["r0", "r2", "r4"]
    assert queues.pop("r2") is entries[2]
    assert queues.pop("r2") is None
    queues.check_integrity()
    assert [e.request_id for e in queues.bucket(0)] == ["r0", "r4"]
    assert queues.depths() == (2, 3)
    assert queues.queued_tokens() == (200, 300)
    assert queues.head(1) is entries[1]


def test_planner_buckets_by_uncached_tokens() -> None:
    """A 5000-token prompt with a 4800-token prefix-cache hit is a short prefill."""
    planner = PrefillPlanner(PrefillPlannerConfig(), StepCostModel())
    assert planner.add(PrefillView("hit", 5000, num_computed_tokens=4800)) == 0
    assert planner.add(PrefillView("miss", 5000)) == 2
    assert planner.add(PrefillView("huge", 100_000, num_computed_tokens=10)) == 3
    assert planner.stats().queue_depths == (1, 0, 1, 1)
    assert planner.stats().queued_tokens == (200, 0, 5000, 99_990)


def test_planner_takes_requests_as_they_are() -> None:
    """`Request` satisfies `PrefillSource`: the scheduler can hand its requests over."""
    planner = PrefillPlanner(PrefillPlannerConfig(), StepCostModel())
    req = Request("r", list(range(600)), SamplingParams())
    req.num_computed_tokens = 96
    assert planner.add(req) == 0
    plan = planner.plan()
    assert [(c.request_id, c.start_position, c.num_new_tokens) for c in plan.chunks] == [
        ("r", 96, 504)
    ]
