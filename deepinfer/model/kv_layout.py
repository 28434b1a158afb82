"""Paged KV cache tensors in the layout every attention kernel shares (see deepinfer.kernels)."""

from __future__ import annotations

import torch

from deepinfer.model.arch import ModelArch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
"""One (k_cache, v_cache) per layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""


def kv_bytes_per_block(
    arch: ModelArch, block_size: int, dtype: torch.dtype, num_layers: int | None = None
) -> int:
    """Bytes one block takes across all layers (or `num_layers` of them), keys and values."""
    element_bytes = torch.empty((), dtype=dtype).element_size()
    layers = arch.num_layers if num_layers is None else num_layers
    return 2 * layers * block_size * arch.kv_size * element_bytes


def allocate_kv_caches(
    arch: ModelArch,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    num_window_blocks: int = 0,
) -> KVCaches:
    """Zero-filled caches for every layer (zeros: padded reads never see NaN garbage); with
    `num_window_blocks`, the sliding-window layers' caches hold that many blocks (a pool of
    their own) and the full layers' `num_blocks`."""

    def blocks(layer: int) -> int:
        return num_window_blocks if num_window_blocks and arch.window(layer) else num_blocks

    return [
        (
            torch.zeros(blocks(i), block_size, *_head_shape(arch), dtype=dtype, device=device),
            torch.zeros(blocks(i), block_size, *_head_shape(arch), dtype=dtype, device=device),
        )
        for i in range(arch.num_layers)
    ]


def _head_shape(arch: ModelArch) -> tuple[int, int]:
    return arch.num_kv_heads, arch.head_dim


def full_layer_caches(arch: ModelArch, kv_caches: KVCaches, windowed_pool: bool) -> KVCaches:
    """The caches a prefix-cache block's payload covers: every layer's, or with a windowed
    pool of its own the full layers' alone."""
    if not windowed_pool:
        return kv_caches
    return [kv for i, kv in enumerate(kv_caches) if not arch.window(i)]


def check_kv_caches(arch: ModelArch, kv_caches: KVCaches, dtype: torch.dtype | None = None) -> None:
    """Raise ValueError unless `kv_caches` matches `arch` (count, shape) and `dtype` (any one
    floating dtype when None: caches may be stored narrower than the model computes)."""
    if len(kv_caches) != arch.num_layers:
        raise ValueError(f"expected {arch.num_layers} (k, v) cache pairs, got {len(kv_caches)}")
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        for cache in (k_cache, v_cache):
            if cache.dim() != 4 or tuple(cache.shape[2:]) != (arch.num_kv_heads, arch.head_dim):
                raise ValueError(
                    f"layer {layer}: KV cache shape {tuple(cache.shape)} is not "
                    f"[num_blocks, block_size, {arch.num_kv_heads}, {arch.head_dim}]"
                )
            if cache.dtype != (dtype or k_cache.dtype) or not cache.is_floating_point():
                raise ValueError(f"layer {layer}: KV cache dtype {cache.dtype}, expected {dtype}")
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"layer {layer}: k and v caches differ in shape")
        if layer and k_cache.dtype != kv_caches[0][0].dtype:
            raise ValueError(f"layer {layer}: KV caches differ in dtype between layers")
