"""Single-query requests of the torch paged attention (`paged_attention_torch`), attended to
together in a few groups of similar context length (`length_groups`, to bound the padding): a
group's keys are gathered, padded to its longest context, by one `index_select` per cache into
the plan's scratch rows, and one fused SDPA call covers its requests and heads. Padding rows
gather the request's own first key (finite: it was computed) and are cut by an additive -inf
mask, so a cache holding NaN past a context never reaches the output, and no masked copy of K/V
is made. With a window, only each request's last `window` keys are gathered.
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


def decode_group(
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
            decode_group(
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
