"""The KV pool's default size: a quarter of RAM on CPU (at most 4 GiB), 1 GiB on CUDA; the
longest sequence a pool serves."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer.cache.window_group import WindowSpec
from deepinfer.config import CacheConfig, Config, SpeculativeConfig
from deepinfer.engine.kv_sizing import (
    CPU_KV_MEMORY_CAP,
    CUDA_KV_FRACTION,
    kv_memory_bytes,
    max_step_tokens,
    num_kv_blocks,
    serving_max_len,
    split_kv_blocks,
    window_spec,
)
from deepinfer.errors import ModelLoadError
from deepinfer.model.arch import ModelArch


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


def test_cuda_default_is_a_share_of_free_device_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[torch.device] = []

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        asked.append(device)
        return 100 << 30, 141 << 30  # free, total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    got = kv_memory_bytes(CacheConfig(), torch.device("cuda", 1))
    assert got == int((100 << 30) * CUDA_KV_FRACTION) and asked == [torch.device("cuda", 1)]
    assert kv_memory_bytes(CacheConfig(kv_memory_bytes=1 << 30), torch.device("cuda")) == 1 << 30


def test_serving_len_is_the_least_of_positions_pool_and_flag() -> None:
    assert serving_max_len(16, 2048, 9, None) == 128  # the pool less one block
    assert serving_max_len(16, 100, 9, None) == 100  # the model's positions
    assert serving_max_len(16, 2048, 9, 64) == 64  # --max-model-len
    with pytest.raises(ModelLoadError, match="too small"):
        serving_max_len(4, 2048, 4, None)  # 12 tokens


def _gemma_like(windows: tuple[int, ...]) -> ModelArch:
    return ModelArch(
        architecture="gemma3", num_layers=len(windows), hidden_size=64, intermediate_size=128,
        num_heads=4, num_kv_heads=1, head_dim=16, vocab_size=100, rope_theta=1e6,
        rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True,
        layer_windows=windows,
    )  # fmt: skip


def test_windowed_pool_where_the_model_and_setup_allow() -> None:
    pattern = (512, 512, 512, 512, 512, 0) * 3  # Gemma 3 270M's
    spec = window_spec(Config(), _gemma_like(pattern), split=False)
    assert spec is not None and (spec.window, spec.num_windowed_layers) == (512, 15)
    assert window_spec(Config(), _gemma_like((0, 0)), split=False) is None  # none windowed
    assert window_spec(Config(), _gemma_like((512, 512)), split=False) is None  # none full
    assert window_spec(Config(), _gemma_like(pattern), split=True) is None
    every_layer = Config(cache=CacheConfig(window_kv="all"))
    assert window_spec(every_layer, _gemma_like(pattern), split=False) is None
    drafts = Config(speculative=SpeculativeConfig(speculative="layers"))
    assert window_spec(drafts, _gemma_like(pattern), split=False) is None


def test_windowed_pool_is_sized_first_and_the_full_pool_gets_the_rest() -> None:
    spec = WindowSpec(window=512, num_windowed_layers=15)
    config = Config(cache=CacheConfig(kv_memory_bytes=1 << 30))
    full, windowed = split_kv_blocks(config, spec, 3 << 10, 15 << 10, torch.device("cpu"))
    # every request's window (32 blocks, 3 more) for 64 requests and a fill, the step tokens
    assert windowed == 65 * 35 + -(-max_step_tokens(config) // 16) + 1
    assert full == ((1 << 30) - windowed * (15 << 10)) // (3 << 10)
