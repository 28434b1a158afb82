"""The host tier through the engine, on a tiny random Llama with the real tokenizer (CPU with the
tier forced on; on a GPU machine `DEEPINFER_TEST_DEVICE=cuda` runs it with page-locked copies): greedy output is the same cold and when served from host memory after the device
blocks were evicted, and cached tokens are reported by the tier that served them (host, then disk
for the blocks after the host hit), in `Usage` and in the Prometheus metrics."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from deepinfer.api.ops.metrics import ApiMetrics
from deepinfer.config import (
    CacheConfig,
    Config,
    DiskCacheConfig,
    HostCacheConfig,
    HostCacheMode,
    ModelConfig,
    RuntimeConfig,
)
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.core import EngineCore
from deepinfer.engine.types import Usage
from deepinfer.request import SamplingParams

BLOCK = 16
DEVICE = os.environ.get("DEEPINFER_TEST_DEVICE", "cpu")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


HIDDEN, HEADS, KV_HEADS, LAYERS = 64, 4, 2, 2
"""The shape of conftest's `tiny_llama_dir`."""


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_llama_dir: Path) -> Path:
    return tiny_llama_dir


def _config(model_dir: Path, cache_dir: Path, host: HostCacheMode, disk: bool) -> Config:
    return Config(
        model=ModelConfig(path=model_dir, dtype="float32"),
        cache=CacheConfig(num_blocks=24, block_size=BLOCK),  # 23 usable: fillers evict
        disk_cache=DiskCacheConfig(enabled=disk, cache_dir=cache_dir),
        host_cache=HostCacheConfig(enabled=host),
        runtime=RuntimeConfig(device=DEVICE),
    )


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


PROMPT = _prompt(1, 70)  # 4 full blocks may hit ((70 - 1) // 16)
LONGER = PROMPT + _prompt(2, 30)  # 100 tokens: the same 4 blocks, then 2 more
FILLERS = [_prompt(10 + i, 70) for i in range(6)]  # 30 blocks in all: evict everything else


async def _generate(
    engine: AsyncEngine, ids: list[int], metrics: ApiMetrics
) -> tuple[list[int], Usage]:
    stream = metrics.track(await engine.submit(ids, GREEDY), time.monotonic())
    tokens: list[int] = []
    async for out in stream:
        tokens.extend(out.token_ids)
    engine.check_integrity()
    return tokens, out.usage


async def _cold(model_dir: Path, tmp: Path, prompts: list[list[int]]) -> list[list[int]]:
    async with AsyncEngine(_config(model_dir, tmp / "off", "off", disk=False)) as engine:
        metrics = ApiMetrics(engine)
        return [(await _generate(engine, ids, metrics))[0] for ids in prompts]


def _metric(metrics: ApiMetrics, name: str, labels: str = "") -> float:
    line = f"{name}{labels} "
    for row in metrics.render().decode().splitlines():
        if row.startswith(line):
            return float(row[len(line) :])
    raise AssertionError(f"{line!r} not exported")


def test_auto_is_on_with_cuda_only_and_on_forces_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    auto = EngineCore(_config(tiny_model_dir, tmp_path, "auto", disk=False)).tiers.host
    assert (auto is not None) == (DEVICE != "cpu")
    core = EngineCore(_config(tiny_model_dir, tmp_path, "on", disk=False))
    assert core.tiers.host is not None and core.kv.track_new_blocks
    head_dim = HIDDEN // HEADS
    element = core.tiers.copies.kv_caches[0][
        0
    ].element_size()  # float16 KV on CPU by default, else float32
    assert element == (2 if DEVICE == "cpu" else 4)
    assert core.tiers.host.payload_bytes == LAYERS * 2 * BLOCK * KV_HEADS * head_dim * element


@pytest.mark.slow
async def test_served_from_host_after_device_eviction(tiny_model_dir: Path, tmp_path: Path) -> None:
    (reference,) = await _cold(tiny_model_dir, tmp_path, [PROMPT])
    async with AsyncEngine(_config(tiny_model_dir, tmp_path / "c", "on", disk=False)) as engine:
        metrics = ApiMetrics(engine)
        cold, usage = await _generate(engine, PROMPT, metrics)
        assert cold == reference and usage.cached_tokens == 0
        for filler in FILLERS:
            await _generate(engine, filler, metrics)
        warm, usage = await _generate(engine, PROMPT, metrics)
        assert warm == reference
        assert usage.cached_tokens == usage.host_cached_tokens == 4 * BLOCK
        assert usage.device_cached_tokens == 0 and usage.disk_cached_tokens == 0
        host = engine.stats().host
        assert host is not None and host.num_hits == 4 and host.num_evictions == 0
        assert _metric(metrics, "deepinfer_host_cache_hits_total") == 4
        assert _metric(metrics, "deepinfer_cached_prompt_tokens_total", '{tier="host"}') == 64
        assert _metric(metrics, "deepinfer_cached_prompt_tokens_total", '{tier="device"}') == 0


@pytest.mark.slow
async def test_host_then_disk_by_tier(tiny_model_dir: Path, tmp_path: Path) -> None:
    reference = await _cold(tiny_model_dir, tmp_path, [PROMPT, LONGER])
    config = _config(tiny_model_dir, tmp_path / "c", "on", disk=True)
    async with AsyncEngine(config) as engine:  # puts LONGER's 6 prompt blocks on disk
        await _generate(engine, LONGER, ApiMetrics(engine))
    async with AsyncEngine(config) as engine:  # a restart: device and host are empty
        metrics = ApiMetrics(engine)
        tokens, usage = await _generate(engine, PROMPT, metrics)
        assert tokens == reference[0]
        assert usage.cached_tokens == usage.disk_cached_tokens == 4 * BLOCK
        assert usage.host_cached_tokens == 0
        for filler in FILLERS:  # PROMPT's blocks leave the device; the host keeps them
            await _generate(engine, filler, metrics)
        tokens, usage = await _generate(engine, LONGER, metrics)
        assert tokens == reference[1]
        assert (usage.host_cached_tokens, usage.disk_cached_tokens) == (4 * BLOCK, 2 * BLOCK)
        assert usage.cached_tokens == 6 * BLOCK and usage.device_cached_tokens == 0
        assert _metric(metrics, "deepinfer_cached_prompt_tokens_total", '{tier="host"}') == 64
        assert _metric(metrics, "deepinfer_cached_prompt_tokens_total", '{tier="disk"}') == 96
        stats = engine.stats()
        assert stats.host is not None and stats.disk is not None
        assert stats.host.num_hits == 4 and stats.disk.num_hits == 6
