"""Write new K/V rows into paged blocks through a slot mapping."""

from __future__ import annotations

import torch


def store_kv_reference(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, block_id * S + offset
) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
