"""The KV pool's default size: a quarter of RAM on CPU (at most 4 GiB), 1 GiB on CUDA."""

from __future__ import annotations

import os

import torch

from deepinfer.config import CacheConfig, Config
from deepinfer.engine.core import CPU_KV_MEMORY_CAP, _kv_memory_bytes, _num_blocks


def test_cpu_default_is_a_quarter_of_ram_capped() -> None:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    got = _kv_memory_bytes(Config(), torch.device("cpu"))
    assert got == max(1 << 30, min(CPU_KV_MEMORY_CAP, physical // 4))


def test_explicit_budget_and_block_count_win() -> None:
    config = Config(cache=CacheConfig(kv_memory_bytes=3 << 20))
    assert _kv_memory_bytes(config, torch.device("cpu")) == 3 << 20
    assert _num_blocks(config, 1 << 20, torch.device("cpu")) == 3
    exact = Config(cache=CacheConfig(num_blocks=17, kv_memory_bytes=1 << 40))
    assert _num_blocks(exact, 1 << 20, torch.device("cpu")) == 17


def test_cuda_default_stays_one_gib() -> None:
    assert _kv_memory_bytes(Config(), torch.device("cuda")) == 1 << 30
