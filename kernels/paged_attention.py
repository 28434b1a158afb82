"""Paged attention: decode (one query token per request) and prefill over a paged prefix."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]  # [Tq, L]
        out[q_lo:q_hi] = F.scaled_dot_product_attention(
            q[q_lo:q_hi].transpose(0, 1),  # [H, Tq, D]
            k,
            v,
            attn_mask=mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        ).transpose(0, 1)
    return out
