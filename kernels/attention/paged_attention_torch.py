"""Plain-torch paged attention: the CPU path and the tests' oracle (re-exported by `paged_attention`).

A forward pass calls attention once per layer with the same block tables and lengths, so the
work that depends only on those (host copies of the lengths, the cache rows to gather, the key
masks, scratch buffers) is done once per step by `plan_paged_attention_reference` and handed to
every layer as a `PagedAttentionPlan`. Without a plan each call builds its own.

Single-query requests (all of a decode step, and the decodes riding along a prefill chunk) are
attended to together, in groups of similar context length (`paged_attention_groups`); prompt
chunks one request at a time, through torch's fused attention. The caches must be contiguous
(as `kv_layout` allocates them).

Sliding-window layers pass `window`: a query at position p attends to keys p - window + 1..p.
Decode then gathers only each request's last `window` keys (a plan of its own, per call), and a
prefill chunk only the keys from its first query's window on, under a band mask: keys and blocks
before a window are never read (a windowed layer may free them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .paged_attention_groups import DecodePlan, attend_single_queries, plan_decode


@dataclass(frozen=True)
class NativeDecodePlan:
    """The single-query requests of a step for the native CPU kernel (`paged_attention_cpu`),
    which reads the paged caches directly: their rows of q, block tables and lengths."""

    rows: torch.Tensor | None  # [Bs] int64 rows of q; None: every row, in order
    block_tables: torch.Tensor  # [Bs, max_blocks] int32, contiguous
    context_lens: torch.Tensor  # [Bs] int32, contiguous


@dataclass(frozen=True)
class PagedAttentionPlan:
    """One step's attention metadata, shared by every layer (see the module docstring)."""

    query_starts: list[int]  # [B + 1], host copy of query_start_loc
    context_lens: list[int]  # [B], host copy of context_lens
    single_query: list[int]
    """Requests attended to together, through `decode` (those with exactly one new token) or
    `native` (the CPU planner's: those, and short chunks, one kernel row per query); the
    multi-token path skips them."""
    decode: DecodePlan | None  # None when no request has exactly one new token
    native: NativeDecodePlan | None = None
    """Set instead of `decode` by the native CPU backend's planner."""


def plan_paged_attention_reference(
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32
    k_cache: torch.Tensor,  # [N, S, Hkv, D], one layer's: the shape and dtype all layers share
) -> PagedAttentionPlan:
    """The step's plan for the torch references (one host read of the lengths)."""
    starts: list[int] = query_start_loc.tolist()
    lens: list[int] = context_lens.tolist()
    single = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    plan = PagedAttentionPlan(starts, lens, single, None)
    decode = _single_query_plan(plan, block_tables, k_cache, None)
    return PagedAttentionPlan(starts, lens, single, decode)


def _single_query_plan(
    plan: PagedAttentionPlan,
    block_tables: torch.Tensor,
    k_cache: torch.Tensor,
    window: int | None,
) -> DecodePlan | None:
    """The decode plan of the plan's single-query requests (their last `window` keys)."""
    single, starts, lens = plan.single_query, plan.query_starts, plan.context_lens
    if not single:
        return None
    if len(single) == len(lens):  # then T == B: q's rows are the requests
        return plan_decode(block_tables, lens, None, k_cache, window)
    index = torch.tensor(single, device=block_tables.device)
    return plan_decode(
        block_tables.index_select(0, index),
        [lens[b] for b in single],
        [starts[b] for b in single],
        k_cache,
        window,
    )


def paged_decode_attention_reference(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, keys each query attends to (its own included)
    scale: float,
    *,
    plan: PagedAttentionPlan | None = None,
    window: int | None = None,
) -> torch.Tensor:  # [B, H, D]
    """Each request's query over the first `context_lens[b]` keys of its blocks (with `window`,
    the last `window` of them: a sliding-window layer). `plan`, if given, must come from
    `plan_paged_attention_reference` on these very tables and lengths."""
    check_window(window)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if plan is None or window is not None:
        lens = context_lens.tolist() if plan is None else plan.context_lens
        decode = plan_decode(block_tables, lens, None, k_cache, window)
    else:
        assert plan.decode is not None, "a decode plan covers every request"
        decode = plan.decode
    out = None if len(decode.groups) == 1 else torch.empty_like(q)
    return attend_single_queries(q, k_cache, v_cache, decode, scale, out)


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, length: int, first: int = 0
) -> torch.Tensor:
    """Rows `first` to `length` of one request's KV, contiguous: [length - first, Hkv, D] (the
    blocks before `first`'s are not read)."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    skipped = first // block_size
    rows = cache[block_table[skipped:num_blocks].long()]  # [nb, S, Hkv, D]
    start = first - skipped * block_size
    return rows.reshape(-1, cache.shape[2], cache.shape[3])[start : length - skipped * block_size]


def paged_prefill_attention_reference(
    q: torch.Tensor,  # [T, H, D], the new tokens of all requests, concatenated
    k_cache: torch.Tensor,  # [N, S, Hkv, D], already holding the new tokens' K/V
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32, offsets of each request's tokens in q
    context_lens: torch.Tensor,  # [B] int32, cached prefix + new tokens
    scale: float,
    *,
    plan: PagedAttentionPlan | None = None,
    window: int | None = None,
    bf16_from: int = 0,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each request's new tokens over its whole paged context.

    Query i of request b sits at position `context_lens[b] - q_len_b + i` and attends to keys
    0..that position (with `window`, the last `window` of those, its own included: a
    sliding-window layer; keys before are never read): the cached prefix is read from blocks,
    never recomputed. `plan`, if given, must come from `plan_paged_attention_reference` on
    these very inputs. `bf16_from`: see `attend_multi_token_queries`.
    """
    check_window(window)
    if plan is None:
        plan = plan_paged_attention_reference(block_tables, query_start_loc, context_lens, k_cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    decode = (
        plan.decode if window is None else _single_query_plan(plan, block_tables, k_cache, window)
    )
    if decode is not None:
        out = attend_single_queries(q, k_cache, v_cache, decode, scale, out)
    return attend_multi_token_queries(
        q, k_cache, v_cache, block_tables, plan, scale, out, window, bf16_from
    )


def check_window(window: int | None) -> None:
    """A sliding window holds at least one key (None: full attention)."""
    if window is not None and window < 1:
        raise ValueError(f"an attention window holds at least one key, got {window}")


def attend_multi_token_queries(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    plan: PagedAttentionPlan,
    scale: float,
    out: torch.Tensor,  # [T, H, D]
    window: int | None = None,
    bf16_from: int = 0,
) -> torch.Tensor:  # `out`, with the rows of every request of two or more new tokens written
    """`bf16_from` > 0: on CPU, a float32 chunk whose context is that long or longer attends in
    bfloat16 (q, and the keys and values gathered from the cache, rounded to bf16; torch's
    fused kernel sums in float32): 2.7x the rate on AMX, where the probe of `bf16_probe.py`
    found bf16 fast. Perplexity unchanged to 1e-3 at 2048-token windows (bench/RESULTS.md)."""
    starts, singles = plan.query_starts, set(plan.single_query)
    for b, ctx_len in enumerate(plan.context_lens):
        if starts[b + 1] > starts[b] and b not in singles:
            q_lo, q_hi = starts[b], starts[b + 1]
            rows = q[q_lo:q_hi]
            if bf16_from and ctx_len >= bf16_from and rows.dtype == torch.float32:
                rows = rows.to(torch.bfloat16)
            out[q_lo:q_hi] = _prefill_one(
                rows, k_cache, v_cache, block_tables[b], ctx_len, scale, window
            )
    return out


def _prefill_one(
    q: torch.Tensor,  # [Tq, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks]
    ctx_len: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:  # [Tq, H, D]
    """One chunk, the last Tq positions of its context: causal over the whole context, or with
    `window` over the keys from its first query's window on, under a band mask."""
    q_len = q.shape[0]
    first = 0 if window is None else max(0, ctx_len - q_len - window + 1)
    k = _gather_context(k_cache, block_table, ctx_len, first).transpose(0, 1).to(q.dtype)
    v = _gather_context(v_cache, block_table, ctx_len, first).transpose(0, 1).to(q.dtype)
    if window is None and q_len < ctx_len and q.device.type == "cpu":
        return _prefill_after_prefix(q, k, v, scale)  # [Hkv, L, D] each
    causal = window is None and q_len == ctx_len
    # 4-D inputs keep torch on its fused CPU kernel (3-D ones fall back to the slow math path)
    return F.scaled_dot_product_attention(
        q[None].transpose(1, 2),  # [1, H, Tq, D]
        k[None],  # [1, Hkv, L, D]
        v[None],
        attn_mask=None if causal else _band_mask(q_len, ctx_len, first, window, q.device),
        is_causal=causal,
        scale=scale,
        enable_gqa=q.shape[1] != k_cache.shape[2],
    )[0].transpose(0, 1)


def _prefill_after_prefix(
    q: torch.Tensor,  # [Tq, H, D], the last Tq positions of the context
    k: torch.Tensor,  # [Hkv, L, D], the whole context, the chunk's own keys last
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [Tq, H, D]
    """A chunk after a cached prefix, in two unmasked fused passes merged by log-sum-exp.

    Every query sees the whole prefix, so that pass needs no mask, and a KV head's query heads
    fold into one long query (no GQA copy of the long prefix). The chunk over itself is plain
    causal attention. A dense [Tq, L] mask would push torch onto a slower path (about 1.3x at
    100 x 8000 on one core, more for longer chunks).
    """
    q_len, num_heads, dim = q.shape
    num_kv_heads, ctx_len = k.shape[0], k.shape[1]
    group, prefix = num_heads // num_kv_heads, ctx_len - q_len
    qh = q.transpose(0, 1)  # [H, Tq, D]
    folded = qh.reshape(1, num_kv_heads, group * q_len, dim)
    out_p, lse_p = _flash_cpu(folded, k[None, :, :prefix], v[None, :, :prefix], False, scale)
    k_c = k[:, prefix:].repeat_interleave(group, dim=0)[None]  # [1, H, Tq, D]
    v_c = v[:, prefix:].repeat_interleave(group, dim=0)[None]
    out_c, lse_c = _flash_cpu(qh[None], k_c, v_c, True, scale)
    lse_p = lse_p.reshape(num_heads, q_len, 1)
    lse_c = lse_c.reshape(num_heads, q_len, 1)
    lse = torch.logaddexp(lse_p, lse_c)
    out = out_p.reshape(num_heads, q_len, dim) * (lse_p - lse).exp()
    out += out_c.reshape(num_heads, q_len, dim) * (lse_c - lse).exp()
    return out.to(q.dtype).transpose(0, 1)


def _flash_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused CPU attention, with its per-query log-sum-exp: ([1, H, T, D], [1, H, T])."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )
    return out, lse


def _band_mask(
    q_len: int, ctx_len: int, first: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """[1, 1, Tq, L]: the last Tq positions of a context attend causally to keys `first`..,
    each to its last `window` of them when given."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    k_pos = torch.arange(first, ctx_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask[None, None]
