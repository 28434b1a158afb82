"""Paged decode and prefill attention against float64 evaluations of the torch references.

Caches are NaN everywhere a request has no token (block 0, which padded table entries point
to, included), so a kernel that reads past a context or misses a mask fails; outputs are
NaN-poisoned before launch, so an unwritten row fails too.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from deepinfer.kernels.attention.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    paged_prefill_attention_rows,
)
from deepinfer.kernels.dispatch import KernelInputError, KernelUnsupportedError

Close = Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]
DTYPES = [torch.float32, torch.bfloat16]


def paged_cache(
    context_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables): random K/V for each request's tokens, NaN elsewhere."""
    per_request = [-(-n // block_size) for n in context_lens]
    num_blocks = 2 + sum(per_request)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables = torch.zeros(len(context_lens), max(per_request) + 1, dtype=torch.int32)
    free = (torch.randperm(num_blocks - 1) + 1).tolist()  # block 0 stays unused
    for b, n in enumerate(context_lens):
        tables[b, : per_request[b]] = torch.tensor([free.pop() for _ in range(per_request[b])])
        positions = torch.arange(n)
        slots = tables[b, positions // block_size].long() * block_size + positions % block_size
        for cache in (k_cache, v_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
                n, num_kv_heads, head_dim
            ).to(dtype)
    return k_cache, v_cache, tables


DECODE_CASES = [
    # (group, kv heads, head dim, block size, context lens, partition tokens)
    (1, 2, 32, 16, [1, 16, 17, 33], 512),
    (3, 2, 64, 16, [200, 5, 64, 129], 64),
    (8, 1, 32, 8, [1, 130, 63], 64),
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "kv_heads", "dim", "block_size", "lens", "part"), DECODE_CASES)
def test_paged_decode_attention(
    assert_close: Close,
    dtype: torch.dtype,
    group: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    lens: list[int],
    part: int,
) -> None:
    k_cache, v_cache, tables = paged_cache(lens, kv_heads, dim, block_size, dtype)
    q = torch.randn(len(lens), group * kv_heads, dim).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    scale = dim**-0.5
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(
        q, k_cache, v_cache, tables, context_lens, scale, partition_tokens=part, out=out
    )
    expected = paged_decode_attention_reference(
        q.double(), k_cache.double(), v_cache.double(), tables, context_lens, scale
    )
    assert_close(out, expected, dtype)


def test_decode_is_batch_invariant_and_hint_only_trims_the_grid() -> None:
    lens = [150, 3, 70]
    k_cache, v_cache, tables = paged_cache(lens, 2, 32, 16, torch.bfloat16)
    q = torch.randn(3, 6, 32).bfloat16()
    context_lens = torch.tensor(lens, dtype=torch.int32)
    batched = paged_decode_attention(
        q, k_cache, v_cache, tables, context_lens, 0.2, partition_tokens=64
    )
    for b in range(3):
        alone = paged_decode_attention(
            q[b : b + 1], k_cache, v_cache, tables[b : b + 1], context_lens[b : b + 1], 0.2,
            partition_tokens=64, max_context_len=lens[b],
        )  # fmt: skip
        assert torch.equal(alone[0], batched[b])


PREFILL_CASES = [
    # (group, kv heads, head dim, block size, [(context len, new tokens)], max_query_len hint)
    (1, 2, 32, 16, [(20, 1), (40, 7), (5, 0), (16, 16)], None),
    (3, 2, 64, 16, [(70, 70), (33, 17)], 70),
    (8, 1, 32, 8, [(1, 1), (130, 66)], 66),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("group", "kv_heads", "dim", "block_size", "requests", "hint"), PREFILL_CASES
)
def test_paged_prefill_attention(
    assert_close: Close,
    dtype: torch.dtype,
    group: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    requests: list[tuple[int, int]],
    hint: int | None,
) -> None:
    lens = [ctx for ctx, _ in requests]
    k_cache, v_cache, tables = paged_cache(lens, kv_heads, dim, block_size, dtype)
    q_lens = torch.tensor([0] + [n for _, n in requests])
    query_start_loc = q_lens.cumsum(0).to(torch.int32)
    q = torch.randn(int(q_lens.sum()), group * kv_heads, dim).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    scale = dim**-0.5
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(
        q, k_cache, v_cache, tables, query_start_loc, context_lens, scale,
        max_query_len=hint, out=out,
    )  # fmt: skip
    expected = paged_prefill_attention_reference(
        q.double(), k_cache.double(), v_cache.double(), tables, query_start_loc, context_lens, scale
    )
    assert_close(out, expected, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("window", [1, 9, 40, 100, 1000])
def test_sliding_window(assert_close: Close, window: int) -> None:
    """Decode (several partitions), prompt chunks after a prefix, and the one-row-per-query
    path, each query over its last `window` keys. Keys before the earliest window of each
    request are NaN and the blocks wholly before it point at block 0 (NaN): a tile that loaded
    them would poison the output."""
    block_size, requests = 8, [(150, 1), (40, 7), (130, 66), (17, 1), (70, 70)]
    lens = [n for n, _ in requests]
    k_cache, v_cache, tables = paged_cache(lens, 2, 32, block_size, torch.float32)
    for b, (n, t) in enumerate(requests):
        unseen = max(0, n - t - window + 1)
        positions = torch.arange(unseen)
        slots = tables[b, positions // block_size].long() * block_size + positions % block_size
        for cache in (k_cache, v_cache):
            cache.view(-1, 2, 32)[slots] = float("nan")
        tables[b, : unseen // block_size] = 0
    q_lens = torch.tensor([0] + [t for _, t in requests])
    starts = q_lens.cumsum(0).to(torch.int32)
    q = torch.randn(int(q_lens.sum()), 6, 32)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    expected = paged_prefill_attention_reference(
        q.double(), k_cache.double(), v_cache.double(), tables, starts, context_lens, 0.2,
        window=window,
    )  # fmt: skip
    chunks = paged_prefill_attention(
        q, k_cache, v_cache, tables, starts, context_lens, 0.2, window=window
    )
    assert_close(chunks, expected, torch.float32)
    rows = paged_prefill_attention_rows(
        q, k_cache, v_cache, tables, starts, context_lens, 0.2, window=window
    )
    assert_close(rows, expected, torch.float32)
    decoding = torch.tensor([b for b, (_, t) in enumerate(requests) if t == 1])
    decoded = paged_decode_attention(
        q.index_select(0, starts[decoding].long()), k_cache, v_cache,
        tables.index_select(0, decoding), context_lens.index_select(0, decoding), 0.2,
        partition_tokens=64, window=window,
    )  # fmt: skip
    assert_close(decoded, expected.index_select(0, starts[decoding].long()), torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_rows_are_decode_steps_at_their_positions(
    assert_close: Close, dtype: torch.dtype
) -> None:
    """The batch-invariant mode's prompt attention: each query's output is, bit for bit, the
    decode kernel's for one request at its position, whatever chunk it came in; and close to
    the reference."""
    requests = [(70, 70), (33, 17), (5, 0), (600, 3)]  # (context len, new tokens)
    lens = [ctx for ctx, _ in requests]
    k_cache, v_cache, tables = paged_cache(lens, 2, 32, 16, dtype)
    q_lens = torch.tensor([0] + [n for _, n in requests])
    query_start_loc = q_lens.cumsum(0).to(torch.int32)
    q = torch.randn(int(q_lens.sum()), 6, 32).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_prefill_attention_rows(
        q, k_cache, v_cache, tables, query_start_loc, context_lens, 0.2
    )
    expected = paged_prefill_attention_reference(
        q.double(), k_cache.double(), v_cache.double(), tables, query_start_loc, context_lens, 0.2
    )
    assert_close(out, expected, dtype)
    row = 0
    for b, (ctx, n) in enumerate(requests):
        for i in range(n):
            alone = paged_decode_attention(
                q[row : row + 1], k_cache, v_cache, tables[b : b + 1],
                torch.tensor([ctx - n + i + 1], dtype=torch.int32), 0.2,
            )  # fmt: skip
            assert torch.equal(alone[0], out[row]), (b, i)
            row += 1


def test_prefill_of_one_token_matches_decode() -> None:
    k_cache, v_cache, tables = paged_cache([45], 1, 16, 16, torch.float32)
    q, context_lens = torch.randn(1, 4, 16), torch.tensor([45], dtype=torch.int32)
    decode = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.25)
    prefill = paged_prefill_attention(
        q, k_cache, v_cache, tables, torch.tensor([0, 1], dtype=torch.int32), context_lens, 0.25
    )
    torch.testing.assert_close(prefill, decode, atol=1e-6, rtol=1e-6)


def _decode_inputs(
    heads: int = 4, kv_heads: int = 2, dim: int = 16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    k_cache = torch.zeros(4, 8, kv_heads, dim)
    return (
        torch.zeros(2, heads, dim),
        k_cache,
        k_cache.clone(),
        torch.zeros(2, 3, dtype=torch.int32),
        torch.ones(2, dtype=torch.int32),
        1.0,
    )


def test_decode_validation() -> None:
    q, k_cache, v_cache, tables, lens, scale = _decode_inputs()
    with pytest.raises(KernelInputError, match="not a multiple"):
        paged_decode_attention(*_decode_inputs(heads=3))
    with pytest.raises(KernelInputError, match="k_cache must have dtype"):
        paged_decode_attention(q, k_cache.bfloat16(), v_cache, tables, lens, scale)
    with pytest.raises(KernelInputError, match="one row per request"):
        paged_decode_attention(q, k_cache, v_cache, tables[:1], lens, scale)
    with pytest.raises(KernelInputError, match="one entry per request"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens[:1], scale)
    with pytest.raises(KernelInputError, match="block_tables must have dtype"):
        paged_decode_attention(q, k_cache, v_cache, tables.float(), lens, scale)
    with pytest.raises(KernelInputError, match="head_dim"):
        paged_decode_attention(q, k_cache[..., :8], v_cache[..., :8], tables, lens, scale)
    with pytest.raises(KernelInputError, match="partition_tokens"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, partition_tokens=100)
    with pytest.raises(KernelInputError, match="max_context_len"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, max_context_len=25)
    with pytest.raises(KernelInputError, match="out must have shape"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out=torch.empty(2, 4, 8))


@pytest.mark.parametrize("dim", [8, 48, 512])
def test_uncovered_head_dims_are_unsupported_not_invalid(dim: int) -> None:
    with pytest.raises(KernelUnsupportedError, match=f"head_dim {dim}"):
        paged_decode_attention(*_decode_inputs(dim=dim))


def test_prefill_validation() -> None:
    q, k_cache, v_cache, tables, lens, scale = _decode_inputs()
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(KernelInputError, match="B \\+ 1 entries"):
        paged_prefill_attention(q, k_cache, v_cache, tables, starts[:2], lens, scale)
    with pytest.raises(KernelInputError, match="max_query_len"):
        paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, scale, max_query_len=3)
    with pytest.raises(KernelInputError, match="v_cache must have dtype"):
        paged_prefill_attention(q, k_cache, v_cache.double(), tables, starts, lens, scale)
