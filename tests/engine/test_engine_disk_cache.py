"""The disk tier through the engine on the real model: identical greedy output with the cache cold,
warm in memory and warm from disk after a restart; other fingerprints never hit; corrupted segment
files are detected and recomputed."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.config import CacheConfig, Config, DiskCacheConfig, ModelConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.types import Usage
from deepinfer.request import SamplingParams
from deepinfer.text.recipe import ChatMessage

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful agent. Tools: search(query), read(url), write(path, text). " * 12
PROMPTS = [
    [ChatMessage("system", SYSTEM), ChatMessage("user", "Find the tallest mountain.")],
    [ChatMessage("system", SYSTEM), ChatMessage("user", "Summarise the water cycle.")],
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def _config(cache_dir: Path, *, block_size: int = 16, disk: bool = True) -> Config:
    return Config(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(num_blocks=256, block_size=block_size),
        disk_cache=DiskCacheConfig(enabled=disk, cache_dir=cache_dir),
    )


async def _run(config: Config) -> tuple[list[list[int]], list[Usage]]:
    tokens, usages = [], []
    async with AsyncEngine(config) as engine:
        for prompt in PROMPTS:
            ids: list[int] = []
            async for out in engine.generate(prompt, GREEDY):
                ids.extend(out.token_ids)
            tokens.append(ids)
            usages.append(out.usage)
        engine.check_integrity()
    return tokens, usages


async def test_cold_warm_and_restart_are_identical(tmp_path: Path) -> None:
    reference, _ = await _run(_config(tmp_path / "off", disk=False))
    cold, cold_usage = await _run(_config(tmp_path / "c"))
    assert cold == reference
    assert cold_usage[0].disk_cached_tokens == 0
    assert cold_usage[1].cached_tokens > 0, "the second prompt shares the system prompt in memory"
    restarted, usage = await _run(_config(tmp_path / "c"))
    assert restarted == reference
    assert usage[0].disk_cached_tokens >= usage[0].prompt_tokens - 32
    # the second prompt finds the shared system prompt on the device, loaded by the first
    assert usage[1].cached_tokens >= usage[1].prompt_tokens - 32


async def test_other_fingerprint_never_hits(tmp_path: Path) -> None:
    await _run(_config(tmp_path / "c"))
    tokens, usage = await _run(_config(tmp_path / "c", block_size=32))
    assert usage[0].cached_tokens == 0 and usage[0].disk_cached_tokens == 0
    assert tokens == (await _run(_config(tmp_path / "off", disk=False)))[0]


async def test_corrupted_segments_are_recomputed(tmp_path: Path) -> None:
    reference, _ = await _run(_config(tmp_path / "c"))
    segments = list((tmp_path / "c").rglob("*.seg"))
    assert segments
    for seg in segments:  # flip bytes all over every segment file
        data = bytearray(seg.read_bytes())
        for i in range(100, len(data), 4099):
            data[i] ^= 0xFF
        seg.write_bytes(bytes(data))
    tokens, usage = await _run(_config(tmp_path / "c"))
    assert tokens == reference
    assert usage[0].disk_cached_tokens == 0
