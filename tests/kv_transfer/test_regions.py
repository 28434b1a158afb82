"""A read's descriptors: block pairs cut into runs consecutive on both sides, each run one
descriptor per region, covering exactly the blocks asked for."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.kv_transfer.regions import KVRegions, Region, runs

pairs = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=30)


@given(pairs)
def test_runs_cover_the_pairs_in_order(blocks: list[tuple[int, int]]) -> None:
    local, remote = [p[0] for p in blocks], [p[1] for p in blocks]
    local_starts, remote_starts, lengths = runs(local, remote)
    expanded = [
        (a + i, b + i)
        for a, b, n in zip(local_starts, remote_starts, lengths, strict=True)
        for i in range(n)
    ]
    assert expanded == blocks
    for j in range(1, len(lengths)):  # maximal: no run continues the one before it
        end = (local_starts[j - 1] + lengths[j - 1], remote_starts[j - 1] + lengths[j - 1])
        assert end != (local_starts[j], remote_starts[j])


def test_descriptors_address_each_region() -> None:
    regions = KVRegions((Region(1000, 8, 10), Region(5000, 8, 20)), "DRAM", 0)
    rows = regions.descriptors([2, 6], [3, 1])
    assert rows.tolist() == [[1020, 30, 0], [1060, 10, 0], [5040, 60, 0], [5120, 20, 0]]
    assert rows.dtype == np.uint64


def test_descriptors_refuse_blocks_past_the_end() -> None:
    regions = KVRegions((Region(0, 8, 10),), "DRAM", 0)
    with pytest.raises(ValueError, match="past the end"):
        regions.descriptors([6], [3])
