"""Paged attention: decode (one query token per request) and prefill over a paged prefix."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import paged_attention_kernels as _k
from .dispatch import (
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

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.0 / math.log(2.0)
DECODE_PARTITION_TOKENS = 512
"""Keys per decode partition: fixed, so a request's result never depends on the batch."""
BLOCK_N = 64
PREFILL_BLOCK_M = 64
_MAX_GROUP = 64


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` rows of one request's KV, contiguous: [L, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    rows = cache[block_table[:num_blocks].long()]  # [nb, S, Hkv, D]
    return rows.reshape(-1, cache.shape[2], cache.shape[3])[:length]


def paged_decode_attention_reference(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, keys each query attends to (its own included)
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max().item())
    num_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long()
    k = k_cache[table].reshape(batch, -1, num_kv_heads, head_dim)[:, :max_len]  # [B, L, Hkv, D]
    v = v_cache[table].reshape(batch, -1, num_kv_heads, head_dim)[:, :max_len]
    positions = torch.arange(max_len, device=q.device)
    mask = positions[None, :] < context_lens[:, None].to(q.device)  # [B, L]
    # Rows past a context hold whatever the blocks hold (NaN, stale data): zero them, or a
    # masked-out NaN in V would still poison the output through 0 * NaN.
    k = k.masked_fill(~mask[:, :, None, None], 0.0)
    v = v.masked_fill(~mask[:, :, None, None], 0.0)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, H, 1, D]
        k.transpose(1, 2),  # [B, Hkv, L, D]
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.squeeze(2)


def paged_prefill_attention_reference(
    q: torch.Tensor,  # [T, H, D], the new tokens of all requests, concatenated
    k_cache: torch.Tensor,  # [N, S, Hkv, D], already holding the new tokens' K/V
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32, offsets of each request's tokens in q
    context_lens: torch.Tensor,  # [B] int32, cached prefix + new tokens
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each request's new tokens over its whole paged context.

    Query i of request b sits at position `context_lens[b] - q_len_b + i` and attends to keys
    0..that position: the cached prefix is read from blocks, never recomputed.
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), context_lens.tolist()
    for b, ctx_len in enumerate(lens):
        q_lo, q_hi = starts[b], starts[b + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        k = _gather_context(k_cache, block_tables[b], ctx_len).transpose(0, 1)  # [Hkv, L, D]
        v = _gather_context(v_cache, block_tables[b], ctx_len).transpose(0, 1)
        # 4-D inputs keep torch on its fused CPU kernel (3-D ones fall back to the slow math path)
        out[q_lo:q_hi] = F.scaled_dot_product_attention(
            q[None, q_lo:q_hi].transpose(1, 2),  # [1, H, Tq, D]
            k[None],  # [1, Hkv, L, D]
            v[None],
            attn_mask=None if q_len == ctx_len else _causal_mask(q_len, ctx_len, q.device),
            is_causal=q_len == ctx_len,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )[0].transpose(0, 1)
    return out


def _causal_mask(q_len: int, ctx_len: int, device: torch.device) -> torch.Tensor:
    """[1, 1, Tq, L]: the last Tq positions of a context of L attend causally."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)
    return (torch.arange(ctx_len, device=device)[None, :] <= q_pos[:, None])[None, None]


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
) -> torch.Tensor:  # [B, H, D]
    """Triton version of `paged_decode_attention_reference`.

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
        GROUP=group, BLOCK_G=max(16, next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, PARTITION=partition_tokens,
        UPCAST=q.device.type == "cpu", PRECISION=dot_precision(q.dtype), num_warps=4,
    )  # fmt: skip
    if num_partitions > 1:
        _k.decode_reduce_kernel[(batch, num_heads)](
            context_lens, out, part_acc, part_ml, out.stride(0), out.stride(1), num_partitions,
            HEAD_DIM=head_dim, PARTITION=partition_tokens, num_warps=1,
        )  # fmt: skip
    return out


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
) -> torch.Tensor:  # [T, H, D]
    """Triton version of `paged_prefill_attention_reference`.

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
        block_tables.stride(0), out.stride(0), out.stride(1), scale * _LOG2E,
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=BLOCK_N, UPCAST=q.device.type == "cpu",
        PRECISION=dot_precision(q.dtype), num_warps=4,
    )  # fmt: skip
    return out
