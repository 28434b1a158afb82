"""Sizing the KV pool at start-up: its dtype, its number of blocks, and the longest sequence it
can serve. Pure functions of the config and what the device reports."""

from __future__ import annotations

import os

import torch

from deepinfer.config import CacheConfig
from deepinfer.errors import ConfigError, ModelLoadError
from deepinfer.runner.device import resolve_kv_dtype

CPU_KV_MEMORY_CAP = 4 << 30
"""Default KV pool on CPU: a quarter of physical memory, at most this."""

MIN_SERVING_LEN = 16
"""A pool that cannot hold this many tokens of one sequence is refused."""


def kv_memory_bytes(config: CacheConfig, device: torch.device) -> int:
    """The KV pool's budget: as configured, else 1 GiB on CUDA and a quarter of RAM on CPU
    (between 1 GiB and `CPU_KV_MEMORY_CAP`)."""
    if config.kv_memory_bytes is not None:
        return config.kv_memory_bytes
    if device.type != "cpu":
        return 1 << 30
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # not every platform reports it
        return 1 << 30
    return max(1 << 30, min(CPU_KV_MEMORY_CAP, physical // 4))


def num_kv_blocks(config: CacheConfig, bytes_per_block: int, device: torch.device) -> int:
    """Blocks in a pool: as configured, else as many as the budget holds (at least two)."""
    if config.num_blocks is not None:
        return config.num_blocks
    return max(2, kv_memory_bytes(config, device) // bytes_per_block)


def kv_cache_dtype(
    config: CacheConfig, dtype: torch.dtype, backend: str, device: torch.device
) -> torch.dtype:
    """The KV cache dtype; a narrower one than the serving dtype needs a CPU backend (the Triton
    kernels read caches of the queries' dtype). `auto` narrows on CPU only."""
    narrow_ok = device.type == "cpu" and backend != "triton"
    kv_dtype = resolve_kv_dtype(config.kv_dtype, dtype, narrow_ok)
    if kv_dtype != dtype and backend == "triton":
        raise ConfigError(
            f"--kv-dtype {config.kv_dtype} under {dtype} serving needs the cpu or torch "
            "attention backend, not triton"
        )
    return kv_dtype


def serving_max_len(
    block_size: int, max_positions: int, num_blocks: int, max_model_len: int | None
) -> int:
    """The longest sequence served: the model's positions, a pool of `num_blocks` less one, and
    `--max-model-len`, whichever is least; raises ModelLoadError when that is uselessly short."""
    max_len = min(max_positions, (num_blocks - 1) * block_size)
    if max_model_len is not None:
        max_len = min(max_len, max_model_len)
    if max_len < MIN_SERVING_LEN:
        raise ModelLoadError(f"the KV pool of {num_blocks} blocks is too small to serve")
    return max_len
