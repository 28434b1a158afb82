"""Paged KV cache tensors in the layout every attention kernel shares (see deepinfer.kernels)."""

from __future__ import annotations

import math
import mmap

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
    """Caches for every layer that read as zeros (padded reads never see NaN garbage); with
    `num_window_blocks`, the sliding-window layers' caches hold that many blocks (a pool of
    their own) and the full layers' `num_blocks`. On CPU the caches are reserved, not touched
    (see `reserve_zeros`): resident memory grows with the blocks written, not the pool's size."""

    def blocks(layer: int) -> int:
        return num_window_blocks if num_window_blocks and arch.window(layer) else num_blocks

    def cache(layer: int) -> torch.Tensor:
        shape = (blocks(layer), block_size, *_head_shape(arch))
        return reserve_zeros(shape, dtype, torch.device(device))

    return [(cache(i), cache(i)) for i in range(arch.num_layers)]


def reserve_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros. On CPU it lives in a private anonymous mapping that nothing writes
    here: the kernel maps its shared zero page on reads and gives a page memory on its first
    write, so an unused region costs address space only. The tensor owns the mapping (unmapped
    when the last view of it is freed). Elsewhere, `torch.zeros`."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or num_bytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


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
