"""The `cpu` backend's paged attention (native decode kernel, kernels/cpu/paged_attention.c)
against the float64 torch reference, on caches that are NaN wherever no token was written (a
key read past a context, or from the wrong block, poisons the output)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.attention.paged_attention_cpu import (
    native_decode_applies,
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
    plan_paged_attention_cpu,
)
from deepinfer.kernels.attention.paged_attention_torch import (
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
)
from deepinfer.kernels.native.cpu_native import native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="no native CPU kernels here")


def _caches(
    lens: list[int], block_size: int, kv_heads: int, dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 (k_cache, v_cache, block_tables): shuffled blocks, random K/V, NaN elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    per_request = [-(-n // block_size) for n in lens]
    num_blocks = 1 + sum(per_request)
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    tables = torch.zeros(len(lens), max(per_request) + 1, dtype=torch.int32)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    for b, n in enumerate(lens):
        blocks = [free.pop() for _ in range(per_request[b])]
        tables[b, : len(blocks)] = torch.tensor(blocks)
        for cache in (k_cache, v_cache):
            rows = cache.view(-1, kv_heads, dim)
            slots = torch.tensor(
                [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
            )
            rows[slots] = torch.randn(n, kv_heads, dim, generator=gen)
    return k_cache, v_cache, tables


@pytest.mark.parametrize(
    ("group", "dim", "block_size"),
    [(3, 64, 16), (1, 64, 16), (4, 128, 16), (3, 64, 5), (10, 32, 16), (2, 16, 3)],
)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_decode_matches_float64_reference(
    group: int, dim: int, block_size: int, cache_dtype: torch.dtype
) -> None:
    """float16 caches (`--kv-dtype float16`, under float32 queries) are converted as they are
    loaded: the result is the float64 attention over the float16 values."""
    lens = [1, 3, 4, 17, 300, 61, 5, 129]
    kv_heads = 2
    k_cache, v_cache, tables = _caches(lens, block_size, kv_heads, dim, seed=group * dim)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    assert native_decode_applies(k_cache, kv_heads * group)
    # q as a strided view of fused QKV rows, as the model passes it
    qkv = torch.randn(len(lens), (kv_heads * group + 2 * kv_heads) * dim)
    q = qkv[:, : kv_heads * group * dim].view(len(lens), kv_heads * group, dim)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    got = paged_decode_attention_cpu(q, k_cache, v_cache, tables, context_lens, 0.3)
    want = paged_decode_attention_reference(
        q.double(), k_cache.double(), v_cache.double(), tables, context_lens, 0.3
    )
    assert got.dtype == torch.float32 and not got.isnan().any()
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-5)


def test_mixed_step_native_decodes_and_torch_chunks() -> None:
    """Single-query rows and short chunks (native, a kernel row per query) next to a long chunk
    (torch) and an empty request."""
    # (context, new tokens); the last chunk's 40 x 700 query-key pairs are past the native limit
    requests = [(300, 1), (40, 7), (5, 0), (600, 1), (33, 33), (17, 1), (700, 40)]
    lens = [n for n, _ in requests]
    k_cache, v_cache, tables = _caches(lens, 16, 3, 64, seed=7)
    q_lens = torch.tensor([0] + [t for _, t in requests])
    starts = q_lens.cumsum(0).to(torch.int32)
    q = torch.randn(int(q_lens.sum()), 9, 64)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    plan = plan_paged_attention_cpu(tables, starts, context_lens, k_cache)
    assert plan.native is not None and plan.decode is None and plan.single_query == [0, 1, 3, 4, 5]
    assert plan.native.rows is not None and plan.native.rows.tolist() == list(range(43))
    assert plan.native.context_lens[1:8].tolist() == list(range(34, 41))  # causal, per query
    got = paged_prefill_attention_cpu(
        q, k_cache, v_cache, tables, starts, context_lens, 0.125, plan=plan
    )
    want = paged_prefill_attention_reference(
        q.double(), k_cache.double(), v_cache.double(), tables, starts, context_lens, 0.125
    )
    for b, (_, t) in enumerate(requests):
        lo, hi = int(starts[b]), int(starts[b + 1])
        if t:
            torch.testing.assert_close(got[lo:hi].double(), want[lo:hi], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_long_context_chunks_attend_in_bf16_from_bf16_from(cache_dtype: torch.dtype) -> None:
    """With `bf16_from`, a chunk with that much context attends in bf16 (close to float64, not
    float32's bits); shorter chunks and single-query rows keep float32's bits exactly."""
    requests = [(700, 40), (300, 1), (200, 30), (520, 520)]  # (context, new tokens)
    lens = [n for n, _ in requests]
    k_cache, v_cache, tables = _caches(lens, 16, 2, 64, seed=11)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    q_lens = torch.tensor([0] + [t for _, t in requests])
    starts = q_lens.cumsum(0).to(torch.int32)
    q = torch.randn(int(q_lens.sum()), 6, 64, generator=torch.Generator().manual_seed(3))
    context_lens = torch.tensor(lens, dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, starts, context_lens, 0.125)
    exact = paged_prefill_attention_cpu(*args)
    got = paged_prefill_attention_cpu(*args, bf16_from=512)
    want = paged_prefill_attention_reference(
        q.double(), k_cache.double(), v_cache.double(), tables, starts, context_lens, 0.125
    )
    for b, (ctx, _) in enumerate(requests):
        lo, hi = int(starts[b]), int(starts[b + 1])
        if ctx >= 512:
            assert not torch.equal(got[lo:hi], exact[lo:hi])
            torch.testing.assert_close(got[lo:hi].double(), want[lo:hi], atol=3e-2, rtol=3e-2)
        else:
            assert torch.equal(got[lo:hi], exact[lo:hi])


@pytest.mark.parametrize("window", [1, 7, 16, 64, 100, 1000])
@pytest.mark.parametrize("block_size", [16, 5])
def test_sliding_window_matches_reference(window: int, block_size: int) -> None:
    """A sliding-window layer's step: decodes and short chunks through the kernel (each row
    over its own last `window` keys), a long chunk through torch. The keys before the earliest
    window of each request are NaN and the blocks wholly before it freed (-1 in the table): a
    run that read them would poison the output."""
    requests = [(300, 1), (40, 7), (600, 1), (33, 33), (17, 1), (700, 40), (129, 1)]
    lens = [n for n, _ in requests]
    k_cache, v_cache, tables = _caches(lens, block_size, 3, 64, seed=window)
    for b, (n, t) in enumerate(requests):
        unseen = max(0, n - t - window + 1)
        for cache in (k_cache, v_cache):
            rows = cache.view(-1, 3, 64)
            for p in range(unseen):
                rows[int(tables[b, p // block_size]) * block_size + p % block_size] = float("nan")
        tables[b, : unseen // block_size] = -1
    q_lens = torch.tensor([0] + [t for _, t in requests])
    starts = q_lens.cumsum(0).to(torch.int32)
    q = torch.randn(int(q_lens.sum()), 9, 64, generator=torch.Generator().manual_seed(window))
    context_lens = torch.tensor(lens, dtype=torch.int32)
    plan = plan_paged_attention_cpu(tables, starts, context_lens, k_cache)
    assert plan.native is not None
    got = paged_prefill_attention_cpu(
        q, k_cache, v_cache, tables, starts, context_lens, 0.125, plan=plan, window=window
    )
    want = paged_prefill_attention_reference(
        q.double(), k_cache.double(), v_cache.double(), tables, starts, context_lens, 0.125,
        window=window,
    )  # fmt: skip
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    decoding = torch.tensor([b for b, (_, t) in enumerate(requests) if t == 1])
    got = paged_decode_attention_cpu(
        q.index_select(0, starts[decoding].long()), k_cache, v_cache,
        tables.index_select(0, decoding), context_lens.index_select(0, decoding), 0.125,
        window=window,
    )  # fmt: skip
    want = want.index_select(0, starts[decoding].long())
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_other_dtypes_take_the_torch_path() -> None:
    k_cache, v_cache, tables = _caches([20, 9], 16, 2, 64, seed=3)
    k64, v64 = k_cache.double(), v_cache.double()
    assert not native_decode_applies(k64)
    starts = torch.arange(3, dtype=torch.int32)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    plan = plan_paged_attention_cpu(tables, starts, lens, k64)
    assert plan.native is None and plan.decode is not None
    q = torch.randn(2, 4, 64, dtype=torch.float64)
    got = paged_decode_attention_cpu(q, k64, v64, tables, lens, 0.125, plan=plan)
    assert torch.equal(got, paged_decode_attention_reference(q, k64, v64, tables, lens, 0.125))


def test_queries_the_kernel_cannot_take_fall_back_to_torch() -> None:
    """More query heads per KV head than the kernel takes (20 > 16): the same rows, by torch."""
    lens = [7, 40]
    k_cache, v_cache, tables = _caches(lens, 16, 1, 32, seed=9)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    plan = plan_paged_attention_cpu(
        tables, torch.arange(3, dtype=torch.int32), context_lens, k_cache
    )
    assert plan.native is not None and not native_decode_applies(k_cache, 20)
    q = torch.randn(2, 20, 32)
    got = paged_decode_attention_cpu(q, k_cache, v_cache, tables, context_lens, 0.2, plan=plan)
    want = paged_decode_attention_reference(
        q.double(), k_cache.double(), v_cache.double(), tables, context_lens, 0.2
    )
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize(("group", "dim", "block_size"), [(3, 64, 16), (1, 128, 5), (10, 32, 3)])
def test_float16_caches_in_a_step_with_prompt_chunks(group: int, dim: int, block_size: int) -> None:
    """Native decodes beside a prompt chunk (torch path) over the same float16 caches."""
    lens = [1, 4, 17, 300, 61]
    kv_heads = 2
    k32, v32, tables = _caches(lens, block_size, kv_heads, dim, seed=group + dim)
    k_cache, v_cache = k32.half(), v32.half()
    context_lens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.tensor([0, 1, 4, 5, 6, 7], dtype=torch.int32)  # request 1: 3 new tokens
    chunk_q = torch.randn(7, kv_heads * group, dim)
    got = paged_prefill_attention_cpu(chunk_q, k_cache, v_cache, tables, starts, context_lens, 0.3)
    want = paged_prefill_attention_reference(
        chunk_q.double(), k_cache.double(), v_cache.double(), tables, starts, context_lens, 0.3
    )
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_every_row_attends_a_prompt_as_decodes_do(cache_dtype: torch.dtype) -> None:
    """The batch-invariant planner (`every_row`): a 300-token prompt's queries, attended as one
    chunk, as two chunks cut anywhere, or each as a decode of its own beside other requests,
    give the same bits. Without it the long chunk goes to torch, in another order."""
    n, heads = 300, 9
    k_cache, v_cache, tables = _caches([n, 50], 16, 3, 64, seed=11)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    q = torch.randn(n, heads, 64)

    def attend(lo: int, hi: int, every_row: bool = True) -> torch.Tensor:
        """Queries lo..hi-1 of request 0 as one chunk, after a one-query decode of request 1."""
        chunk = torch.cat([torch.randn(1, heads, 64), q[lo:hi]])
        starts = torch.tensor([0, 1, 1 + hi - lo], dtype=torch.int32)
        lens = torch.tensor([50, hi], dtype=torch.int32)
        table = tables[[1, 0]]
        plan = plan_paged_attention_cpu(table, starts, lens, k_cache, every_row=every_row)
        out = paged_prefill_attention_cpu(
            chunk, k_cache, v_cache, table, starts, lens, 0.125, plan=plan
        )
        return out[1:]

    whole = attend(0, n)
    assert torch.equal(torch.cat([attend(0, 137), attend(137, n)]), whole)
    decodes = torch.cat([attend(p, p + 1) for p in range(0, n, 23)])
    assert torch.equal(decodes, whole[::23])
    want = paged_prefill_attention_reference(
        q.double(), k_cache.double(), v_cache.double(), tables[:1],
        torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32), 0.125,
    )  # fmt: skip
    torch.testing.assert_close(whole.double(), want, atol=2e-5, rtol=2e-5)
    assert not torch.equal(attend(0, n, every_row=False), whole)  # torch's fused order
