"""What the worker tests on the tiny random Llama share: a small engine config, token prompts of
a few lengths, and running them all at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

from deepinfer.config import (
    CacheConfig,
    Config,
    DiskCacheConfig,
    ModelConfig,
    SchedulerConfig,
    WorkersConfig,
)
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.request import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def tiny_config(model_dir: Path, workers: WorkersConfig, num_blocks: int = 96) -> Config:
    return Config(
        model=ModelConfig(path=model_dir, dtype="float32"),
        cache=CacheConfig(num_blocks=num_blocks),
        disk_cache=DiskCacheConfig(enabled=False),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        workers=workers,
    )


def token_prompts() -> list[list[int]]:
    return [[(i * 37 + j * 11) % 5000 + 100 for j in range(5 + 23 * (i % 4))] for i in range(10)]


async def run_all(
    engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams = GREEDY
) -> list[list[int]]:
    """Every prompt's tokens, generated concurrently."""

    async def one(ids: list[int]) -> list[int]:
        out: list[int] = []
        async for delta in engine.generate(ids, params):
            out.extend(delta.token_ids)
        return out

    return await asyncio.gather(*(one(p) for p in prompts))


async def leave_after(
    engine: AsyncEngine, ids: list[int], params: SamplingParams, keep: int
) -> int:
    """Stream a request and walk away (closing the stream aborts it) after `keep` tokens."""
    n = 0
    async for delta in engine.generate(ids, params):
        n += len(delta.token_ids)
        if n >= keep:
            break
    return n


async def settle(engine: AsyncEngine) -> None:
    """Wait until no request is running or waiting (aborts are applied between steps)."""
    for _ in range(300):
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("requests still running")
