"""The torch paged-attention references and their per-step plan, against a per-request float64
oracle written with plain loops (no gather, no padding, no grouping).

Caches are NaN wherever a request has no token, so padding that reaches the output fails.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from deepinfer.kernels.attention.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
    plan_paged_attention,
    plan_paged_attention_reference,
)
from deepinfer.kernels.attention.paged_attention_groups import GROUP_COST_KEYS, length_groups

BLOCK_SIZE = 16
KV_HEADS, GROUP, DIM = 3, 3, 64


def _caches(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables): shuffled blocks, random K/V per token, NaN elsewhere."""
    per_request = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = 1 + sum(per_request)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, DIM)
    k_cache = torch.full(shape, float("nan"), dtype=torch.float64)
    v_cache = torch.full(shape, float("nan"), dtype=torch.float64)
    tables = torch.zeros(len(lens), max(per_request) + 2, dtype=torch.int32)
    free = (torch.randperm(num_blocks - 1) + 1).tolist()
    for b, n in enumerate(lens):
        tables[b, : per_request[b]] = torch.tensor([free.pop() for _ in range(per_request[b])])
        for cache in (k_cache, v_cache):
            rows = cache.view(-1, KV_HEADS, DIM)
            for p in range(n):
                rows[int(tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE] = torch.randn(
                    KV_HEADS, DIM, dtype=torch.float64
                )
    return k_cache, v_cache, tables


def _oracle(
    q: torch.Tensor,  # [Tq, H, D]: the last Tq positions of a context of `length`
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    length: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        position = length - q.shape[0] + i
        first = 0 if window is None else max(0, position - window + 1)
        for h in range(q.shape[1]):
            scores, values = [], []
            for p in range(first, position + 1):
                slot = int(table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                key = k_cache.view(-1, KV_HEADS, DIM)[slot, h // GROUP]
                scores.append(float(q[i, h] @ key) * scale)
                values.append(v_cache.view(-1, KV_HEADS, DIM)[slot, h // GROUP])
            weights = torch.tensor(scores, dtype=torch.float64).softmax(0)
            out[i, h] = (weights[:, None] * torch.stack(values)).sum(0)
    return out


LENS = [1, 17, 300, 310, 600, 40, 590, 250, 16]


def test_decode_matches_oracle_with_and_without_a_plan() -> None:
    torch.manual_seed(0)
    k_cache, v_cache, tables = _caches(LENS)
    q = torch.randn(len(LENS), KV_HEADS * GROUP, DIM, dtype=torch.float64)
    lens = torch.tensor(LENS, dtype=torch.int32)
    starts = torch.arange(len(LENS) + 1, dtype=torch.int32)
    plan = plan_paged_attention_reference(tables, starts, lens, k_cache)
    assert plan.decode is not None and len(plan.decode.groups) > 1  # the grouped path
    planned = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.125, plan=plan)
    alone = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.equal(planned, alone)
    for b, n in enumerate(LENS):
        expected = _oracle(q[b : b + 1], k_cache, v_cache, tables[b], n, 0.125)
        torch.testing.assert_close(planned[b : b + 1], expected, atol=1e-10, rtol=1e-10)


def test_decode_of_a_strided_query_view() -> None:
    """The model passes q as a view of its fused QKV rows."""
    torch.manual_seed(1)
    k_cache, v_cache, tables = _caches(LENS[:4])
    qkv = torch.randn(4, (KV_HEADS * GROUP + 2 * KV_HEADS) * DIM, dtype=torch.float64)
    q = qkv[:, : KV_HEADS * GROUP * DIM].view(4, KV_HEADS * GROUP, DIM)
    lens = torch.tensor(LENS[:4], dtype=torch.int32)
    out = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.2)
    expected = paged_decode_attention_reference(q.contiguous(), k_cache, v_cache, tables, lens, 0.2)
    assert torch.equal(out, expected)


def test_prefill_with_single_query_rows_matches_oracle() -> None:
    """Decodes riding along prefill chunks (and a request with no new token) in one call."""
    torch.manual_seed(2)
    requests = [(300, 1), (40, 7), (5, 0), (600, 1), (33, 33), (17, 1)]  # (context, new tokens)
    lens = [n for n, _ in requests]
    k_cache, v_cache, tables = _caches(lens)
    q_lens = torch.tensor([0] + [t for _, t in requests])
    starts = q_lens.cumsum(0).to(torch.int32)
    q = torch.randn(int(q_lens.sum()), KV_HEADS * GROUP, DIM, dtype=torch.float64)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    plan = plan_paged_attention_reference(tables, starts, context_lens, k_cache)
    assert plan.single_query == [0, 3, 5]
    out = paged_prefill_attention_reference(
        q, k_cache, v_cache, tables, starts, context_lens, 0.125, plan=plan
    )
    for b, (n, t) in enumerate(requests):
        lo, hi = int(starts[b]), int(starts[b + 1])
        if t:
            expected = _oracle(q[lo:hi], k_cache, v_cache, tables[b], n, 0.125)
            torch.testing.assert_close(out[lo:hi], expected, atol=1e-10, rtol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("window", [1, 5, 16, 100, 2000])
def test_sliding_window_matches_oracle(window: int) -> None:
    """A sliding-window layer: each query attends to its last `window` positions, in decode
    (grouped, with and without the step's plan) and in prefill chunks after a prefix, with
    decodes riding along. Keys before a window are NaN: they must never be read."""
    torch.manual_seed(4)
    requests = [(300, 1), (40, 7), (600, 1), (33, 33), (17, 1), (250, 90)]  # (context, new)
    lens = [n for n, _ in requests]
    k_cache, v_cache, tables = _caches(lens)
    for b, (n, t) in enumerate(requests):  # poison every key no query of the step can see,
        unseen = max(0, n - t - window + 1)
        for cache in (k_cache, v_cache):
            rows = cache.view(-1, KV_HEADS, DIM)
            for p in range(unseen):
                rows[int(tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE] = float("nan")
        tables[b, : unseen // BLOCK_SIZE] = -1  # and the blocks wholly before it: freed
    q_lens = torch.tensor([0] + [t for _, t in requests])
    starts = q_lens.cumsum(0).to(torch.int32)
    q = torch.randn(int(q_lens.sum()), KV_HEADS * GROUP, DIM, dtype=torch.float64)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    plan = plan_paged_attention_reference(tables, starts, context_lens, k_cache)
    out = paged_prefill_attention_reference(
        q, k_cache, v_cache, tables, starts, context_lens, 0.125, plan=plan, window=window
    )
    for b, n in enumerate(lens):
        lo, hi = int(starts[b]), int(starts[b + 1])
        expected = _oracle(q[lo:hi], k_cache, v_cache, tables[b], n, 0.125, window)
        torch.testing.assert_close(out[lo:hi], expected, atol=1e-10, rtol=1e-10)
    decoding = [b for b, (_, t) in enumerate(requests) if t == 1]
    index = torch.tensor(decoding)
    d_tables, d_lens = tables.index_select(0, index), context_lens.index_select(0, index)
    d_q = q.index_select(0, starts[index].long())
    d_starts = torch.arange(len(decoding) + 1, dtype=torch.int32)
    d_plan = plan_paged_attention_reference(d_tables, d_starts, d_lens, k_cache)
    for step_plan in (d_plan, None):
        got = paged_decode_attention_reference(
            d_q, k_cache, v_cache, d_tables, d_lens, 0.125, plan=step_plan, window=window
        )
        for i, b in enumerate(decoding):
            torch.testing.assert_close(got[i : i + 1], out[int(starts[b]) : int(starts[b]) + 1])
    with pytest.raises(ValueError, match="at least one key"):
        paged_decode_attention_reference(d_q, k_cache, v_cache, d_tables, d_lens, 0.1, window=0)


def test_triton_launchers_take_the_plan_and_need_none() -> None:
    torch.manual_seed(3)
    k_cache, v_cache, tables = _caches([20, 70])
    k_cache, v_cache = k_cache.float(), v_cache.float()
    q, lens = torch.randn(2, KV_HEADS * GROUP, DIM), torch.tensor([20, 70], dtype=torch.int32)
    starts = torch.arange(3, dtype=torch.int32)
    assert plan_paged_attention(tables, starts, lens, k_cache) is None
    plan = plan_paged_attention_reference(tables, starts, lens, k_cache)
    with_plan = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, plan=plan)
    assert torch.equal(with_plan, paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125))


@pytest.mark.parametrize(
    "lens",
    [[5], [7, 7, 7], [600, 590, 300, 310, 10, 12], list(range(1, 200, 3)), [1000, 1, 1, 1]],
)
def test_length_groups_partition_and_never_pad_more(lens: list[int]) -> None:
    groups = length_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert all(g == sorted(g) for g in groups)
    padded = sum(len(g) * max(lens[i] for i in g) for g in groups)
    assert padded <= len(lens) * max(lens)
    for group, after in itertools.pairwise(groups):  # a split saves its cost
        saved = len(after) * (max(lens[i] for i in group) - max(lens[i] for i in after))
        assert saved >= GROUP_COST_KEYS
    if len(set(lens)) == 1:
        assert len(groups) == 1


def test_grouping_bounds_padding_on_spread_lengths() -> None:
    lens = [300 + (i * 37) % 301 for i in range(32)]
    groups = length_groups(lens)
    padded = sum(len(g) * max(lens[i] for i in g) for g in groups)
    assert padded < 1.25 * sum(lens) < len(lens) * max(lens)
    assert sum(len(g) for g in groups) == 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_after_a_prefix_in_low_precision(dtype: torch.dtype) -> None:
    """Chunks after a cached prefix take the split path (prefix and chunk merged by their
    log-sum-exp); checked against float64 dense masked attention."""
    torch.manual_seed(3)
    requests = [(700, 130), (260, 3), (64, 64), (900, 1)]  # (context, new tokens)
    lens = [n for n, _ in requests]
    k64, v64, tables = _caches(lens)
    q_lens = torch.tensor([0] + [t for _, t in requests])
    starts = q_lens.cumsum(0).to(torch.int32)
    q64 = torch.randn(int(q_lens.sum()), KV_HEADS * GROUP, DIM, dtype=torch.float64)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_prefill_attention_reference(
        q64.to(dtype), k64.to(dtype), v64.to(dtype), tables, starts, context_lens, 0.125
    )
    assert out.dtype == dtype
    expected = paged_prefill_attention_reference(q64, k64, v64, tables, starts, context_lens, 0.125)
    for b, (n, t) in enumerate(requests[:2]):  # the oracle's loops are slow: spot-check two
        lo = int(starts[b])
        rows = slice(lo + t - 2, lo + t)
        oracle = _oracle(q64[rows], k64, v64, tables[b], n, 0.125)  # the last two positions
        torch.testing.assert_close(expected[rows], oracle, atol=1e-10, rtol=1e-10)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
