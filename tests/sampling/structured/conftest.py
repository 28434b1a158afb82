"""A tiny random Llama engine for the corpus: a random model stresses the grammar hardest."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from deepinfer.config import (
    CacheConfig,
    Config,
    DiskCacheConfig,
    ModelConfig,
    SchedulerConfig,
    WorkersConfig,
)
from deepinfer.engine.async_engine import AsyncEngine


def tiny_structured_config(
    model_dir: Path, workers: WorkersConfig, num_blocks: int = 1200, max_num_seqs: int = 32
) -> Config:
    return Config(
        model=ModelConfig(path=model_dir, dtype="float32"),
        cache=CacheConfig(num_blocks=num_blocks),
        disk_cache=DiskCacheConfig(enabled=False),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, max_waiting=512
        ),
        workers=workers,
    )


@pytest.fixture(scope="module")
async def tiny_structured_engine(tiny_llama_dir: Path) -> AsyncIterator[AsyncEngine]:
    """Colocated, 32 requests at once."""
    config = tiny_structured_config(tiny_llama_dir, WorkersConfig(colocated=True))
    async with AsyncEngine(config) as engine:
        yield engine
