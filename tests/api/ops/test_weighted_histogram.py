"""The inter-token latency histogram takes a frame's tokens in one observation: its exposition
must be what prometheus_client's `Histogram` gives for the same values observed one by one."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from deepinfer.api.ops.weighted_histogram import WeightedHistogram

BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)
SAMPLE = re.compile(r"^(x_seconds_(?:bucket\{le=\"[^\"]+\"\}|count|sum)) (\S+)$", re.M)


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    return {
        name: float(value) for name, value in SAMPLE.findall(generate_latest(registry).decode())
    }


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.001, 0.0011, 0.5, 1.0, 2.0]) | st.floats(0, 3),
            st.integers(1, 9),
        ),
        max_size=40,
    )
)
def test_equals_one_observation_per_token(observations: list[tuple[float, int]]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    weighted = WeightedHistogram("x_seconds", "doc", BUCKETS, ours)
    plain = Histogram("x_seconds", "doc", buckets=BUCKETS, registry=theirs)
    for value, count in observations:
        weighted.observe(value, count)
        for _ in range(count):
            plain.observe(value)
    got, want = _samples(ours), _samples(theirs)
    assert got.keys() == want.keys() and len(got) == len(BUCKETS) + 3  # +Inf, count, sum
    for name, value in want.items():
        assert abs(got[name] - value) <= 1e-9 * max(1.0, abs(value)), name
