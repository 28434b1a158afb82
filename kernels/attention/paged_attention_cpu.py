"""Paged attention for the `cpu` backend: single-query requests (decode) through the native
kernel (`cpu/paged_attention.c`), which reads K/V straight from the paged caches instead of
gathering a padded copy as the torch path does; prompt chunks through the torch reference.

Same signatures as the references in `paged_attention_torch` (`window` included: the kernel
counts each row's last `window` keys). The planner returns the torch
plan (and the functions the torch path) wherever the native kernel does not apply: caches not
float32 or float16 or not on CPU, head sizes it does not take, or no native library here.
"""

from __future__ import annotations

import torch

from ..native.cpu_abi import AttentionArgs
from ..native.cpu_native import native_available, native_library
from .paged_attention_torch import (
    NativeDecodePlan,
    PagedAttentionPlan,
    attend_multi_token_queries,
    check_window,
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
    plan_paged_attention_reference,
)

MAX_HEAD_DIM = 256
"""DI_MAX_HEAD_DIM of cpu/deepinfer_kernels.h: the largest head size the kernel takes."""
NATIVE_KV_DTYPES = (torch.float32, torch.float16)
"""Cache dtypes the kernel reads (float16 converted to float32 as it is loaded)."""
MAX_GROUP = 16
"""DI_MAX_GROUP of cpu/deepinfer_kernels.h: the most query heads per KV head."""
NATIVE_MAX_CHUNK_PAIRS = 16384
"""Chunks of up to this many query-key pairs go through the kernel, one row per query."""


def native_decode_applies(k_cache: torch.Tensor, num_heads: int | None = None) -> bool:
    _, _, num_kv_heads, head_dim = k_cache.shape
    return (
        k_cache.device.type == "cpu"
        and k_cache.dtype in NATIVE_KV_DTYPES
        and k_cache.is_contiguous()
        and head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and (num_heads is None or (num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP))
        and native_available()
    )  # fmt: skip


def plan_paged_attention_cpu(
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    *,
    every_row: bool = False,
) -> PagedAttentionPlan:
    """Which queries the native kernel attends, one row each: decode rows and short chunks, or
    with `every_row` every query (the batch-invariant mode: a query's attention is then the
    same sum in the same order whether its chunk was a decode, a verification or a prompt of
    any length, so a prefix read from the cache attends as one computed in the step)."""
    if not native_decode_applies(k_cache):
        return plan_paged_attention_reference(block_tables, query_start_loc, context_lens, k_cache)
    starts: list[int] = query_start_loc.tolist()
    lens: list[int] = context_lens.tolist()
    native_reqs = [
        b
        for b in range(len(lens))
        if _native_applies(starts[b + 1] - starts[b], lens[b], every_row)
    ]
    if not native_reqs:
        return PagedAttentionPlan(starts, lens, native_reqs, None)
    tables, ctx = block_tables.to(torch.int32), context_lens.to(torch.int32)
    if len(native_reqs) == len(lens) and starts[-1] == len(lens):  # T == B: rows are requests
        native = NativeDecodePlan(None, tables.contiguous(), ctx.contiguous())
        return PagedAttentionPlan(starts, lens, native_reqs, None, native)
    # each query row of a short chunk is a request of its own: its position + 1 keys
    rows = [r for b in native_reqs for r in range(starts[b], starts[b + 1])]
    owner = [b for b in native_reqs for _ in range(starts[b], starts[b + 1])]
    row_lens = [
        lens[b] - (starts[b + 1] - r) + 1
        for b in native_reqs
        for r in range(starts[b], starts[b + 1])
    ]
    native = NativeDecodePlan(
        None if rows == list(range(starts[-1])) else torch.tensor(rows),
        tables.index_select(0, torch.tensor(owner)).contiguous(),
        torch.tensor(row_lens, dtype=torch.int32),
    )
    return PagedAttentionPlan(starts, lens, native_reqs, None, native)


NATIVE_ALWAYS_ROWS = 33
"""Chunks of at most this many queries always go through the kernel, whatever their context:
a decode step verifying up to 32 draft tokens (config.MAX_DRAFT_TOKENS) (speculative decoding) computes each row exactly as
a plain decode step computes it, so the greedy picks are the same bits."""


def _native_applies(q_len: int, ctx_len: int, every_row: bool = False) -> bool:
    """Whether the kernel attends a request's queries: a few (a decode, a verified draft), or a
    short chunk whose query-key pairs are few (each query then reads its whole context; torch's
    fused prefill reads it once per chunk, which wins for long prompts); any with `every_row`."""
    return 1 <= q_len <= NATIVE_ALWAYS_ROWS or (
        q_len > 1 and (every_row or q_len * ctx_len <= NATIVE_MAX_CHUNK_PAIRS)
    )


def _attend_native(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: NativeDecodePlan,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [Bs, H, D], the plan's rows of q attended
    """The kernel where it applies to these queries (float32, at most MAX_GROUP query heads per
    KV head), else the torch reference on the same rows."""
    rows = q if plan.rows is None else q.index_select(0, plan.rows)
    batch, num_heads, head_dim = rows.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.dtype != torch.float32 or not native_decode_applies(k_cache, num_heads):
        return paged_decode_attention_reference(
            rows, k_cache, v_cache, plan.block_tables, plan.context_lens, scale, window=window
        )
    check_window(window)
    if rows.stride(2) != 1:
        rows = rows.contiguous()
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError("the native kernel needs K and V caches of one shape and dtype")
    if not v_cache.is_contiguous():
        raise ValueError("the native kernel needs contiguous K and V caches")
    out = torch.empty((batch, num_heads, head_dim), dtype=torch.float32)
    if batch:
        tables = plan.block_tables
        args = AttentionArgs(
            q=rows.data_ptr(), q_stride_b=rows.stride(0), q_stride_h=rows.stride(1),
            k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
            block_tables=tables.data_ptr(), max_blocks=tables.shape[1],
            context_lens=plan.context_lens.data_ptr(), out=out.data_ptr(), B=batch, H=num_heads,
            Hkv=num_kv_heads, D=head_dim, S=block_size, scale=scale,
            num_threads=torch.get_num_threads(), kv_f16=int(k_cache.dtype == torch.float16),
            window=window or 0,
        )  # fmt: skip
        native_library().paged_decode_attention(args)
    return out


def paged_decode_attention_cpu(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    *,
    plan: PagedAttentionPlan | None = None,
    window: int | None = None,
) -> torch.Tensor:  # [B, H, D]
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if plan is None:
        starts = torch.arange(q.shape[0] + 1, dtype=torch.int32)
        plan = plan_paged_attention_cpu(block_tables, starts, context_lens, k_cache)
    if plan.native is None:  # the caches are not the kernel's: the torch plan and path
        return paged_decode_attention_reference(
            q, k_cache, v_cache, block_tables, context_lens, scale, plan=plan, window=window
        )
    return _attend_native(q, k_cache, v_cache, plan.native, scale, window)


def paged_prefill_attention_cpu(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    plan: PagedAttentionPlan | None = None,
    window: int | None = None,
    bf16_from: int = 0,
) -> torch.Tensor:  # [T, H, D]
    """`bf16_from`: chunks with that much context or more attend in bf16 (see
    `attend_multi_token_queries`); 0: never."""
    if plan is None:
        plan = plan_paged_attention_cpu(block_tables, query_start_loc, context_lens, k_cache)
    if plan.native is None:
        return paged_prefill_attention_reference(
            q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, plan=plan,
            window=window, bf16_from=bf16_from,
        )  # fmt: skip
    out = torch.empty(q.shape, dtype=q.dtype)
    attended = _attend_native(q, k_cache, v_cache, plan.native, scale, window)
    if plan.native.rows is None:
        out.copy_(attended)
    else:
        out.index_copy_(0, plan.native.rows, attended)
    return attend_multi_token_queries(
        q, k_cache, v_cache, block_tables, plan, scale, out, window, bf16_from
    )
