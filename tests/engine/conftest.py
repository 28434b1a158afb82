"""One real-model engine per test session (loading SmolLM2 takes seconds; do it once)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from deepinfer.config import CacheConfig, Config, ModelConfig, SchedulerConfig, WorkersConfig


def real_config(**cache: int) -> Config:
    return Config(
        model=ModelConfig(dtype="float32", matmul_activations="float32"),  # exact numerics
        cache=CacheConfig(num_blocks=cache.get("num_blocks", 512)),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024),
        # disaggregated (the default), lending idle cores: a lone request uses both
        workers=WorkersConfig(lend_idle_threads=True),
    )


@pytest.fixture(scope="session")
async def real_engine() -> AsyncIterator[object]:
    from deepinfer.engine.async_engine import AsyncEngine

    async with AsyncEngine(real_config()) as engine:
        yield engine
