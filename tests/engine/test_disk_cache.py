"""The disk tier through the engine on the real model: identical greedy output with the cache cold,
warm in memory and warm from disk after a restart; other fingerprints never hit; corrupted segment
files are detected and recomputed. The runs with no disk tier and with a cold one are made once
per module; each test restarts on its own copy of the cold cache."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
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
        model=ModelConfig(dtype="float32", matmul_activations="float32"),  # exact numerics
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


@dataclass(frozen=True)
class ColdRun:
    """The module's shared runs: greedy tokens with no disk tier, and a cold disk tier's first
    run (its cache directory, written and closed, for the tests to restart on or copy)."""

    reference: list[list[int]]
    tokens: list[list[int]]
    usage: list[Usage]
    cache_dir: Path


@pytest.fixture(scope="module")
async def cold(tmp_path_factory: pytest.TempPathFactory) -> ColdRun:
    root = tmp_path_factory.mktemp("disk-cache")
    reference, _ = await _run(_config(root / "off", disk=False))
    tokens, usage = await _run(_config(root / "c"))
    return ColdRun(reference, tokens, usage, root / "c")


def _copy(run: ColdRun, tmp_path: Path) -> Path:
    """A private copy of the cold run's cache directory (tests must not change the shared one)."""
    shutil.copytree(run.cache_dir, tmp_path / "c")
    return tmp_path / "c"


async def test_cold_warm_and_restart_are_identical(cold: ColdRun, tmp_path: Path) -> None:
    assert cold.tokens == cold.reference
    assert cold.usage[0].disk_cached_tokens == 0
    assert cold.usage[1].cached_tokens > 0, "the second prompt shares the system prompt in memory"
    restarted, usage = await _run(_config(_copy(cold, tmp_path)))
    assert restarted == cold.reference
    assert usage[0].disk_cached_tokens >= usage[0].prompt_tokens - 32
    # the second prompt finds the shared system prompt on the device, loaded by the first
    assert usage[1].cached_tokens >= usage[1].prompt_tokens - 32


async def test_other_fingerprint_never_hits(cold: ColdRun, tmp_path: Path) -> None:
    tokens, usage = await _run(_config(_copy(cold, tmp_path), block_size=32))
    assert usage[0].cached_tokens == 0 and usage[0].disk_cached_tokens == 0
    assert tokens == cold.reference


async def test_corrupted_segments_are_recomputed(cold: ColdRun, tmp_path: Path) -> None:
    cache_dir = _copy(cold, tmp_path)
    segments = list(cache_dir.rglob("*.seg"))
    assert segments
    for seg in segments:  # flip bytes all over every segment file
        data = bytearray(seg.read_bytes())
        for i in range(100, len(data), 4099):
            data[i] ^= 0xFF
        seg.write_bytes(bytes(data))
    tokens, usage = await _run(_config(cache_dir))
    assert tokens == cold.reference
    assert usage[0].disk_cached_tokens == 0
