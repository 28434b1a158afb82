"""The sampler's greedy pick (kernels/cpu/sampling.c) against torch's argmax and finiteness check,
on the logits a step gives it: ties, NaN, +-inf, rows taken out of a wider tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.kernels.native.cpu_native import native_available
from deepinfer.kernels.native.greedy import greedy_ids, greedy_ids_reference

pytestmark = pytest.mark.skipif(not native_available(), reason="no native CPU kernels here")
INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("vocab", [1, 7, 8, 49152, 49157])
def test_random_rows_match_torch(vocab: int) -> None:
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab))
    ids = greedy_ids(logits)
    assert ids.dtype == torch.int64
    assert torch.equal(ids, logits.argmax(dim=1))


def test_ties_take_the_first_and_odd_values_give_minus_one() -> None:
    v = 40
    rows = torch.zeros(7, v)
    rows[0, [3, 17, 33]] = 5.0  # a tie: the first
    rows[1, 37] = 1.0  # in the last 8 lanes
    rows[2, 12] = NAN  # a NaN anywhere
    rows[2, 20] = 9.0
    rows[3, 5] = INF  # +inf
    rows[4] = -INF  # nothing above -inf
    rows[5] = -INF
    rows[5, 39] = -1e30  # one finite value among -inf
    rows[6, 0] = -0.0  # -0.0 and 0.0 compare equal: index 0
    want = torch.tensor([3, 37, -1, -1, -1, 39, 0])
    assert torch.equal(greedy_ids(rows), want)
    assert torch.equal(greedy_ids_reference(rows), want)


def test_tail_values_past_the_vector_lanes_count() -> None:
    row = torch.zeros(1, 8 * 3 + 5)
    row[0, 27] = 2.0
    assert greedy_ids(row).tolist() == [27]
    row[0, 28] = NAN
    assert greedy_ids(row).tolist() == [-1]


def test_rows_of_a_wider_tensor() -> None:
    wide = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    rows = wide[:, :64]  # stride 100, unit inner stride
    assert torch.equal(greedy_ids(rows), rows.argmax(dim=1))
    assert torch.equal(greedy_ids(wide[2:3, 10:74]), wide[2:3, 10:74].argmax(dim=1))


def test_what_the_kernel_cannot_take_goes_to_torch() -> None:
    logits = torch.randn(3, 50, dtype=torch.float64)
    assert torch.equal(greedy_ids(logits), logits.argmax(dim=1))
    transposed = torch.randn(50, 3).t()  # inner stride 3
    assert torch.equal(greedy_ids(transposed), transposed.argmax(dim=1))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_big_batch_over_several_threads_matches_torch(threads: int) -> None:
    """A decode step of many rows over a large vocabulary is split over the caller's threads
    but one (3 threads: two share the rows)."""
    logits = torch.randn(97, 49152, generator=torch.Generator().manual_seed(threads))
    logits[5, 100:200] = logits[5].max() + 1  # a tie inside a row
    logits[40, 7] = NAN
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = greedy_ids(logits)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(got, greedy_ids_reference(logits))


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(1, 300),
    rows=st.integers(1, 6),
    levels=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    nan_at=st.none() | st.integers(0, 10_000),
)
def test_ties_anywhere_take_the_first(
    vocab: int, rows: int, levels: int, seed: int, nan_at: int | None
) -> None:
    """Few distinct values: the largest is tied across the vector lanes and the kernel's chains;
    the first index wins, as torch's argmax (a NaN anywhere gives -1)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=g).float()
    if nan_at is not None:
        logits.view(-1)[nan_at % logits.numel()] = NAN
    assert torch.equal(greedy_ids(logits), greedy_ids_reference(logits))
