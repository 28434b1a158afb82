"""Write new K/V rows into paged blocks through a slot mapping: the Triton launcher.

The torch reference lives in `kv_store_torch` (the CPU path imports that module, never this one)
and is re-exported here next to the launcher.
"""

from __future__ import annotations

import torch

from ..dispatch import check, check_tensor, next_power_of_2, require_backend
from ..triton_common import jit, tl
from .kv_store_torch import store_kv_reference

__all__ = ["store_kv", "store_kv_reference"]


@jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per token: copies its [Hkv, D] K and V rows into its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    cache_off = block_id * stride_cb + offset * stride_cs + heads * stride_ch + dims
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    tl.store(k_cache_ptr + cache_off, k, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(v_cache_ptr + cache_off, v, mask=mask)


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64; negative = padding, skipped
) -> None:
    """Triton version of `store_kv_reference`. Slots must be distinct and < N * S (unchecked:
    reading them would cost a device sync)."""
    device = k_cache.device
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, 4, (torch.float32, torch.float16, torch.bfloat16), device)
    check(k_cache.shape == v_cache.shape, "k_cache and v_cache must have the same shape")
    check(k_cache.dtype == v_cache.dtype, "k_cache and v_cache must have the same dtype")
    check(k_cache.stride() == v_cache.stride(), "k_cache and v_cache must have the same strides")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens = k.shape[0] if k.dim() > 0 else 0
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, 3, (k_cache.dtype,), device)
        check(
            tuple(t.shape) == (num_tokens, num_kv_heads, head_dim),
            f"{name} must be [T, {num_kv_heads}, {head_dim}] to match the cache, got {tuple(t.shape)}",
        )
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64), device, False)
    check(slot_mapping.shape[0] == num_tokens, "slot_mapping must have one slot per token")
    require_backend(device, _store_kv_kernel)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
    )
