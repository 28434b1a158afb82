"""Plain-torch paged attention: the CPU path and the tests' oracle (re-exported by `paged_attention`).

A forward pass calls attention once per layer with the same block tables and lengths, so the
work that depends only on those (host copies of the lengths, the cache rows to gather, the key
masks, scratch buffers) is done once per step by `plan_paged_attention_reference` and handed to
every layer as a `PagedAttentionPlan`. Without a plan each call builds its own.

Single-query requests (all of a decode step, and the decodes riding along a prefill chunk) are
attended to together, in a few groups of similar context length (`length_groups`, to bound the
padding): a group's keys are gathered, padded to its longest context, by one `index_select` per
cache into the plan's scratch rows, and one fused SDPA call covers its requests and heads.
Padding rows gather the request's own first key (finite: it was computed) and are cut by an
additive -inf mask, so a cache holding NaN past a context never reaches the output, and no
masked copy of K/V is made. The caches must be contiguous (as `kv_layout` allocates them).

Sliding-window layers pass `window`: a query at position p attends to keys p - window + 1..p.
Decode then gathers only each request's last `window` keys (a plan of its own, per call), and a
prefill chunk only the keys from its first query's window on, under a band mask: keys and blocks
before a window are never read (a windowed layer may free them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP_MIN_FILL = 0.8
"""A length group's shortest context is at least this fraction of its longest (less padding)."""
GROUP_COST_KEYS = 256
"""Key rows of padding that justify one more group (its fixed cost: a few more ops per layer)."""


@dataclass(frozen=True)
class DecodeGroup:
    """Single-query requests of similar context length, keys padded to the longest (L)."""

    rows: torch.Tensor | None  # [Bg] int64, their rows of q and of the output; None: all, in order
    slots: torch.Tensor  # [Bg * L] int64, cache row (block_id * S + offset) of key l of each
    mask: torch.Tensor  # [Bg, 1, 1, L] float32: 0 for keys in the context, -inf past it
    max_len: int


@dataclass(frozen=True)
class DecodePlan:
    """Every single-query request of a step, in length groups, and the scratch rows that each
    group's keys and values are gathered into, layer after layer: one allocation per step
    instead of two per layer (fresh multi-megabyte tensors cost a page fault per 4 KiB)."""

    groups: list[DecodeGroup]
    keys: torch.Tensor  # [max over groups of Bg * L, Hkv * D], the caches' dtype
    values: torch.Tensor


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


def length_groups(lens: list[int]) -> list[list[int]]:
    """Indices of `lens` split into groups of similar length (each ascending), longest first.

    Over descending lengths, a length joins the current group while it is at least
    `GROUP_MIN_FILL` of the group's longest; then a group is merged into the one before it when
    that pads fewer than `GROUP_COST_KEYS` more keys."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        if groups and lens[i] >= GROUP_MIN_FILL * lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    merged = groups[:1]
    for group in groups[1:]:
        if len(group) * (lens[merged[-1][0]] - lens[group[0]]) < GROUP_COST_KEYS:
            merged[-1].extend(group)
        else:
            merged.append(group)
    return [sorted(g) for g in merged]


def _decode_group(
    block_tables: torch.Tensor,  # [Bg, max_blocks]
    lens: list[int],  # [Bg], each in [1, max_blocks * S]
    rows: torch.Tensor | None,
    block_size: int,
    window: int | None = None,
) -> DecodeGroup:
    """With `window`, each request's last `window` keys only (those its query attends to)."""
    device = block_tables.device
    starts = [0 if window is None else max(0, n - window) for n in lens]
    max_len = max(n - s for n, s in zip(lens, starts, strict=True))
    first = torch.tensor(starts, device=device)[:, None]
    positions = first + torch.arange(max_len, device=device)[None, :]  # [Bg, L]
    valid = positions < torch.tensor(lens, device=device)[:, None]
    columns = block_tables.long()
    blocks = torch.gather(columns, 1, (positions // block_size).clamp(max=columns.shape[1] - 1))
    slots = blocks * block_size + positions % block_size  # [Bg, L]
    slots = torch.where(valid, slots, slots[:, :1])
    mask = torch.zeros(valid.shape, dtype=torch.float32, device=device)
    mask.masked_fill_(~valid, float("-inf"))
    return DecodeGroup(rows, slots.reshape(-1), mask[:, None, None, :], max_len)


def plan_decode(
    block_tables: torch.Tensor,  # [B, max_blocks]
    lens: list[int],  # [B], host copy of the context lengths, each >= 1
    rows: list[int] | None,  # [B], each request's row of q; None: request b is row b
    k_cache: torch.Tensor,  # [N, S, Hkv, D], any layer's (for the shape and dtype only)
    window: int | None = None,
) -> DecodePlan:
    """The padded, length-grouped key layout of `paged_decode_attention_reference` (with
    `window`: of each request's last `window` keys)."""
    device = block_tables.device
    groups = []
    seen = lens if window is None else [min(n, window) for n in lens]
    members = length_groups(seen) if len(lens) > 1 else [list(range(len(lens)))]
    for group in members:
        in_order = len(group) == len(lens) and rows is None
        index = torch.tensor(group, device=device)
        row_ids = group if rows is None else [rows[b] for b in group]
        groups.append(
            _decode_group(
                block_tables if in_order else block_tables.index_select(0, index),
                [lens[b] for b in group],
                None if in_order else torch.tensor(row_ids, device=device),
                k_cache.shape[1],
                window,
            )
        )
    num_rows = max((g.slots.numel() for g in groups), default=0)
    keys = torch.empty(
        (num_rows, k_cache.shape[2] * k_cache.shape[3]), dtype=k_cache.dtype, device=k_cache.device
    )
    return DecodePlan(groups, keys, torch.empty_like(keys))


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


def attend_single_queries(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    out: torch.Tensor | None,  # [T, H, D]; may be None when one group covers every row of q
) -> torch.Tensor:  # [T, H, D]: `out` with the plan's rows written
    for group in plan.groups:
        group_q = q if group.rows is None else q.index_select(0, group.rows)
        result = _attend_group(group_q, k_cache, v_cache, group, plan, scale)
        if group.rows is None:
            return result
        assert out is not None, "groups that cover some rows of q need an output"
        out.index_copy_(0, group.rows, result)
    assert out is not None
    return out


def _attend_group(
    q: torch.Tensor,  # [Bg, H, D], one query per request
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,
    group: DecodeGroup,
    plan: DecodePlan,
    scale: float,
) -> torch.Tensor:  # [Bg, H, D]
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    shape = (batch, group.max_len, num_kv_heads, head_dim)
    rows, num_rows = (-1, num_kv_heads * head_dim), group.slots.numel()
    k = torch.index_select(k_cache.reshape(rows), 0, group.slots, out=plan.keys[:num_rows])
    v = torch.index_select(v_cache.reshape(rows), 0, group.slots, out=plan.values[:num_rows])
    k, v = k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)  # [Bg, Hkv, L, D]
    k, v = k.to(q.dtype), v.to(q.dtype)  # caches may be stored narrower than the queries
    # A KV head's G query heads act as G queries of one sequence: K/V are read once per group
    # (no GQA expansion) and the key mask broadcasts over them.
    group_size = num_heads // num_kv_heads
    out = F.scaled_dot_product_attention(
        q.reshape(batch, num_kv_heads, group_size, head_dim),  # [Bg, Hkv, G, D]
        k,  # [Bg, Hkv, L, D]
        v,
        attn_mask=group.mask.to(q.dtype),  # [Bg, 1, 1, L]
        scale=scale,
    )
    return out.reshape(batch, num_heads, head_dim)


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
    _check_window(window)
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
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each request's new tokens over its whole paged context.

    Query i of request b sits at position `context_lens[b] - q_len_b + i` and attends to keys
    0..that position (with `window`, the last `window` of those, its own included: a
    sliding-window layer; keys before are never read): the cached prefix is read from blocks,
    never recomputed. `plan`, if given, must come from `plan_paged_attention_reference` on
    these very inputs.
    """
    _check_window(window)
    if plan is None:
        plan = plan_paged_attention_reference(block_tables, query_start_loc, context_lens, k_cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    decode = (
        plan.decode if window is None else _single_query_plan(plan, block_tables, k_cache, window)
    )
    if decode is not None:
        out = attend_single_queries(q, k_cache, v_cache, decode, scale, out)
    return attend_multi_token_queries(q, k_cache, v_cache, block_tables, plan, scale, out, window)


def _check_window(window: int | None) -> None:
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
) -> torch.Tensor:  # `out`, with the rows of every request of two or more new tokens written
    starts, singles = plan.query_starts, set(plan.single_query)
    for b, ctx_len in enumerate(plan.context_lens):
        if starts[b + 1] > starts[b] and b not in singles:
            q_lo, q_hi = starts[b], starts[b + 1]
            chunk = q[q_lo:q_hi]
            if window is None:
                out[q_lo:q_hi] = _prefill_one(
                    chunk, k_cache, v_cache, block_tables[b], ctx_len, scale
                )
            else:
                table = block_tables[b]
                out[q_lo:q_hi] = _prefill_windowed(
                    chunk, k_cache, v_cache, table, ctx_len, scale, window
                )
    return out


def _prefill_one(
    q: torch.Tensor,  # [Tq, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks]
    ctx_len: int,
    scale: float,
) -> torch.Tensor:  # [Tq, H, D]
    q_len = q.shape[0]
    k = _gather_context(k_cache, block_table, ctx_len).transpose(0, 1).to(q.dtype)  # [Hkv, L, D]
    v = _gather_context(v_cache, block_table, ctx_len).transpose(0, 1).to(q.dtype)
    if q_len < ctx_len and q.device.type == "cpu":
        return _prefill_after_prefix(q, k, v, scale)
    # 4-D inputs keep torch on its fused CPU kernel (3-D ones fall back to the slow math path)
    return F.scaled_dot_product_attention(
        q[None].transpose(1, 2),  # [1, H, Tq, D]
        k[None],  # [1, Hkv, L, D]
        v[None],
        attn_mask=None if q_len == ctx_len else _causal_mask(q_len, ctx_len, q.device),
        is_causal=q_len == ctx_len,
        scale=scale,
        enable_gqa=q.shape[1] != k_cache.shape[2],
    )[0].transpose(0, 1)


def _prefill_windowed(
    q: torch.Tensor,  # [Tq, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks]
    ctx_len: int,
    scale: float,
    window: int,
) -> torch.Tensor:  # [Tq, H, D]
    """A chunk on a sliding-window layer: the keys from the first query's window on, under a
    mask that keeps each query's last `window` positions."""
    q_len = q.shape[0]
    first = max(0, ctx_len - q_len - window + 1)
    k = _gather_context(k_cache, block_table, ctx_len, first).transpose(0, 1).to(q.dtype)
    v = _gather_context(v_cache, block_table, ctx_len, first).transpose(0, 1).to(q.dtype)
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
    k_pos = torch.arange(first, ctx_len, device=q.device)[None, :]
    mask = (k_pos <= q_pos) & (k_pos > q_pos - window)  # [Tq, L]
    return F.scaled_dot_product_attention(
        q[None].transpose(1, 2),  # [1, H, Tq, D]
        k[None],  # [1, Hkv, L, D]
        v[None],
        attn_mask=mask[None, None],
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


def _causal_mask(q_len: int, ctx_len: int, device: torch.device) -> torch.Tensor:
    """[1, 1, Tq, L]: the last Tq positions of a context of L attend causally."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)
    return (torch.arange(ctx_len, device=device)[None, :] <= q_pos[:, None])[None, None]
