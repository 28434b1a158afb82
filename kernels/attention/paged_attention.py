"""Paged attention: decode (one query token per request) and prefill over a paged prefix.

The torch references (and the per-step `PagedAttentionPlan` they share across layers) live in
`paged_attention_torch` and are re-exported here next to their Triton launchers. This module
loads Triton (through `paged_attention_kernels`): the CPU path imports `paged_attention_torch`.
"""

from __future__ import annotations

import math

import torch

from ..dispatch import (
    KernelUnsupportedError,
    cdiv,
    check,
    check_head_dim,
    check_tensor,
    dot_precision,
    next_power_of_2,
    output_buffer,
    require_backend,
)
from . import paged_attention_kernels as _k
from .paged_attention_torch import (
    PagedAttentionPlan,
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
    plan_paged_attention_reference,
)

__all__ = [
    "PagedAttentionPlan",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
    "paged_prefill_attention_rows",
    "plan_paged_attention",
    "plan_paged_attention_reference",
]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.0 / math.log(2.0)
DECODE_PARTITION_TOKENS = 512
"""Keys per decode partition: fixed, so a request's result never depends on the batch."""
BLOCK_N = 64
PREFILL_BLOCK_M = 64
_MAX_GROUP = 64


def _check_paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_requests: int,
) -> None:
    """Shared launcher checks; raises KernelInputError or KernelUnsupportedError."""
    device = q.device
    check_tensor("q", q, 3, _FLOAT_DTYPES, device)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, cache, 4, (q.dtype,), device)
    check(k_cache.shape == v_cache.shape, "k_cache and v_cache must have the same shape")
    check(k_cache.stride() == v_cache.stride(), "k_cache and v_cache must have the same strides")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    check(k_cache.shape[3] == head_dim, f"cache head_dim {k_cache.shape[3]} != q's {head_dim}")
    check(
        num_kv_heads > 0 and num_heads % num_kv_heads == 0,
        f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads",
    )
    check_tensor("block_tables", block_tables, 2, _INDEX_DTYPES, device)
    check(block_tables.shape[0] == num_requests, "block_tables must have one row per request")
    check_tensor("context_lens", context_lens, 1, _INDEX_DTYPES, device)
    check(context_lens.shape[0] == num_requests, "context_lens must have one entry per request")
    check_head_dim(head_dim)
    if num_heads // num_kv_heads > _MAX_GROUP:
        raise KernelUnsupportedError(f"GQA groups above {_MAX_GROUP} heads are not covered")


FULL_ATTENTION = 1 << 30
"""The window the kernels get for full attention: longer than any context."""


def _window(window: int | None) -> int:
    """The kernels' window argument: `window` keys, or all of them (None)."""
    check(window is None or 1 <= window <= FULL_ATTENTION, f"window must be >= 1, got {window}")
    return FULL_ATTENTION if window is None else window


def plan_paged_attention(
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
) -> PagedAttentionPlan | None:
    """Triton version of `plan_paged_attention_reference`: the kernels need no plan (None),
    and building one would cost a device sync."""
    return None


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, in [1, max_blocks * S] (unchecked: a device sync)
    scale: float,
    *,
    max_context_len: int | None = None,
    partition_tokens: int = DECODE_PARTITION_TOKENS,
    out: torch.Tensor | None = None,
    plan: PagedAttentionPlan | None = None,
    window: int | None = None,
) -> torch.Tensor:  # [B, H, D]
    """Triton version of `paged_decode_attention_reference` (`plan` is the torch path's, unused).

    One program per (request, KV head, partition of `partition_tokens` keys) serves the whole
    GQA group, so each K/V row is read once. `max_context_len` (a host-side bound) only trims the
    grid; without it the bound is the block table's width, so no device sync is needed.
    `out`, if given, receives the result (any row/head strides).
    """
    batch = q.shape[0] if q.dim() == 3 else 0
    _check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, batch)
    check(
        partition_tokens >= BLOCK_N and partition_tokens & (partition_tokens - 1) == 0,
        f"partition_tokens must be a power of two >= {BLOCK_N}, got {partition_tokens}",
    )
    require_backend(q.device, _k.decode_partition_kernel)
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    bound = block_tables.shape[1] * block_size
    if max_context_len is not None:
        check(0 < max_context_len <= bound, f"max_context_len must be in [1, {bound}]")
        bound = max_context_len
    out = output_buffer("out", out, tuple(q.shape), q.dtype, q.device)
    num_partitions = cdiv(bound, partition_tokens)
    if batch == 0 or num_partitions == 0:
        return out
    group = num_heads // num_kv_heads
    part_acc = torch.empty(
        (batch, num_heads, num_partitions, head_dim), dtype=torch.float32, device=q.device
    )
    part_ml = torch.empty(
        (batch, num_heads, num_partitions, 2), dtype=torch.float32, device=q.device
    )
    _k.decode_partition_kernel[(batch, num_kv_heads, num_partitions)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), num_partitions, scale * _LOG2E,
        _window(window),
        GROUP=group, BLOCK_G=max(16, next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, PARTITION=partition_tokens,
        UPCAST=q.device.type == "cpu", PRECISION=dot_precision(q.dtype), num_warps=4,
    )  # fmt: skip
    if num_partitions > 1:
        _k.decode_reduce_kernel[(batch, num_heads)](
            context_lens, out, part_acc, part_ml, out.stride(0), out.stride(1), num_partitions,
            _window(window), HEAD_DIM=head_dim, PARTITION=partition_tokens, num_warps=1,
        )  # fmt: skip
    return out


def paged_prefill_attention_rows(
    q: torch.Tensor,  # [T, H, D], the new tokens of all requests, concatenated
    k_cache: torch.Tensor,  # [N, S, Hkv, D], already holding the new tokens' K/V
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32, cached prefix + new tokens
    scale: float,
    *,
    plan: PagedAttentionPlan | None = None,
    window: int | None = None,
) -> torch.Tensor:  # [T, H, D]
    """`paged_prefill_attention` with every query given to the decode kernel as a request of
    its own (its request's blocks, its position + 1 keys): the batch-invariant mode's prompt
    attention. A query's output is then the one a decode step at its position computes, bit
    for bit, whatever the chunk, the batch or the cached prefix (the decode kernel's
    partitions are fixed and merged in order). Row tables and lengths are made on the device
    (no sync); `plan` is the torch path's, unused."""
    batch = block_tables.shape[0] if block_tables.dim() == 2 else 0
    _check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, batch)
    check_tensor("query_start_loc", query_start_loc, 1, _INDEX_DTYPES, q.device)
    check(query_start_loc.shape[0] == batch + 1, "query_start_loc must have B + 1 entries")
    rows = torch.arange(q.shape[0], device=q.device)
    ends = query_start_loc[1:].long()
    owner = torch.searchsorted(ends, rows, right=True).clamp_(max=max(batch - 1, 0))
    own_lens = context_lens.long()[owner]
    row_lens = (own_lens - (ends[owner] - 1 - rows)).clamp_(min=1)  # rows past every request: 1
    row_lens = torch.minimum(row_lens, own_lens)
    tables = block_tables.index_select(0, owner)
    row_lens_32 = row_lens.to(torch.int32)
    return paged_decode_attention(q, k_cache, v_cache, tables, row_lens_32, scale, window=window)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D], the new tokens of all requests, concatenated
    k_cache: torch.Tensor,  # [N, S, Hkv, D], already holding the new tokens' K/V
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32, offsets of each request's tokens in q
    context_lens: torch.Tensor,  # [B] int32, cached prefix + new tokens
    scale: float,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    plan: PagedAttentionPlan | None = None,
    window: int | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Triton version of `paged_prefill_attention_reference` (`plan` is the torch path's, unused).

    Requires 0 <= query lengths <= context_lens <= max_blocks * S (unchecked: a device sync).
    `max_query_len` (a host-side bound) only trims the grid; the default bound is T. `out`, if
    given, receives the result; rows of tokens outside every request are left untouched.
    """
    batch = block_tables.shape[0] if block_tables.dim() == 2 else 0
    _check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, batch)
    check_tensor("query_start_loc", query_start_loc, 1, _INDEX_DTYPES, q.device)
    check(query_start_loc.shape[0] == batch + 1, "query_start_loc must have B + 1 entries")
    require_backend(q.device, _k.prefill_kernel)
    num_tokens, num_heads, head_dim = q.shape
    bound = num_tokens if max_query_len is None else max_query_len
    check(0 <= bound <= num_tokens, f"max_query_len must be in [0, {num_tokens}]")
    out = output_buffer("out", out, tuple(q.shape), q.dtype, q.device)
    if batch == 0 or bound == 0:
        return out
    _k.prefill_kernel[(batch, cdiv(bound, PREFILL_BLOCK_M), num_heads)](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), scale * _LOG2E, _window(window),
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=BLOCK_N, UPCAST=q.device.type == "cpu",
        PRECISION=dot_precision(q.dtype), num_warps=4,
    )  # fmt: skip
    return out
