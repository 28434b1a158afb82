"""Sizing the KV pool at start-up: its dtype, its number of blocks, and the longest sequence it
can serve. Pure functions of the config and what the device reports."""

from __future__ import annotations

import logging
import os

import torch

from deepinfer.cache.window_group import WindowSpec, window_pool_blocks
from deepinfer.config import CacheConfig, Config
from deepinfer.errors import ConfigError, ModelLoadError
from deepinfer.model.arch import ModelArch
from deepinfer.runner.device import resolve_kv_dtype
from deepinfer.scheduler.prediction import PREDICTION_DRAFT_TOKENS

log = logging.getLogger(__name__)

CPU_KV_MEMORY_CAP = 4 << 30
"""Default KV pool on CPU: a quarter of physical memory, at most this."""

MIN_SERVING_LEN = 16
"""A pool that cannot hold this many tokens of one sequence is refused."""


CUDA_KV_FRACTION = 0.8
"""Default KV pool on CUDA: this share of the device memory free when the pool is made (after
the weights: the rest is for activations, CUDA graphs and the sampler's logits)."""


def kv_memory_bytes(config: CacheConfig, device: torch.device) -> int:
    """The KV pool's budget: as configured, else on CUDA `CUDA_KV_FRACTION` of the device's free
    memory, on CPU a quarter of RAM (between 1 GiB and `CPU_KV_MEMORY_CAP`), elsewhere 1 GiB."""
    if config.kv_memory_bytes is not None:
        return config.kv_memory_bytes
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * CUDA_KV_FRACTION)
        log.info("KV pool on %s: %.1f GiB (%.0f%% of free memory)", device, budget / (1 << 30),
                 100 * CUDA_KV_FRACTION)  # fmt: skip
        return budget
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


def window_spec(config: Config, arch: ModelArch, split: bool) -> WindowSpec | None:
    """The windowed layers' own pool (`--window-kv window`), or None: every layer in the main
    pool (the model has no windowed layer, `--window-kv all`, or a setup that needs it)."""
    if config.cache.window_kv == "all" or not arch.windowed:
        return None
    worker_drafts = config.speculative.speculative in ("layers", "draft-model", "mtp")
    if split or worker_drafts:
        why = "separate prefill and decode device groups" if split else "a worker-side draft"
        log.info("--window-kv window is not supported with %s: every layer keeps its KV", why)
        return None
    windows = [arch.window(i) or 0 for i in range(arch.num_layers)]
    if all(windows):  # no full layer: nothing for the prefix cache's blocks to hold
        log.info("--window-kv window needs some full-attention layers: every layer keeps its KV")
        return None
    return WindowSpec(max(windows), sum(1 for w in windows if w))


def max_step_tokens(config: Config) -> int:
    """Most tokens the steps in flight compute at once (both workers', or the one's)."""
    s, w = config.scheduler, config.workers
    if w.colocated:
        return s.max_num_batched_tokens
    spec = config.speculative
    configured = spec.num_draft_tokens if spec.speculative != "none" else 0
    max_drafts = max(configured, PREDICTION_DRAFT_TOKENS)  # a request's prediction drafts too
    return w.prefill_max_batched_tokens + s.max_num_seqs * (1 + max_drafts)


def split_kv_blocks(
    config: Config,
    spec: WindowSpec,
    full_block_bytes: int,
    window_block_bytes: int,
    device: torch.device,
) -> tuple[int, int]:
    """(full-layer blocks, windowed-layer blocks): the windowed pool sized for the worst case
    (`window_pool_blocks`), the full pool from what the budget leaves (or `--num-blocks`)."""
    block_size = config.cache.block_size
    num_window = window_pool_blocks(
        spec, block_size, config.scheduler.max_num_seqs, max_step_tokens(config)
    )
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks, num_window
    left = kv_memory_bytes(config.cache, device) - num_window * window_block_bytes
    return max(2, left // full_block_bytes), num_window
