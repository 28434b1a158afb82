"""The KV pool's default size: a quarter of RAM on CPU (at most 4 GiB), 1 GiB on CUDA; the
longest sequence a pool serves."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer.config import CacheConfig
from deepinfer.engine.kv_sizing import (
    CPU_KV_MEMORY_CAP,
    kv_memory_bytes,
    num_kv_blocks,
    serving_max_len,
)
from deepinfer.errors import ModelLoadError


def test_cpu_default_is_a_quarter_of_ram_capped() -> None:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    got = kv_memory_bytes(CacheConfig(), torch.device("cpu"))
    assert got == max(1 << 30, min(CPU_KV_MEMORY_CAP, physical // 4))


def test_explicit_budget_and_block_count_win() -> None:
    config = CacheConfig(kv_memory_bytes=3 << 20)
    assert kv_memory_bytes(config, torch.device("cpu")) == 3 << 20
    assert num_kv_blocks(config, 1 << 20, torch.device("cpu")) == 3
    exact = CacheConfig(num_blocks=17, kv_memory_bytes=1 << 40)
    assert num_kv_blocks(exact, 1 << 20, torch.device("cpu")) == 17


def test_cuda_default_stays_one_gib() -> None:
    assert kv_memory_bytes(CacheConfig(), torch.device("cuda")) == 1 << 30


def test_serving_len_is_the_least_of_positions_pool_and_flag() -> None:
    assert serving_max_len(16, 2048, 9, None) == 128  # the pool less one block
    assert serving_max_len(16, 100, 9, None) == 100  # the model's positions
    assert serving_max_len(16, 2048, 9, 64) == 64  # --max-model-len
    with pytest.raises(ModelLoadError, match="too small"):
        serving_max_len(4, 2048, 4, None)  # 12 tokens
