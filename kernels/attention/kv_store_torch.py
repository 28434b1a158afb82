"""Plain-torch write of new K/V rows into paged blocks: the CPU path and the tests' oracle
(re-exported by `kv_store`, next to its Triton launcher)."""

from __future__ import annotations

import torch


def store_kv_reference(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, block_id * S + offset; negative = padding, skipped
) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):  # padding rows (rare): drop them
        slots, k, v = slots[keep], k[keep], v[keep]
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)  # caches may be stored narrower
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, v)
