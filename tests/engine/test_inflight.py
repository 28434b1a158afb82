"""Eight requests with the same new 2k-token prefix, arriving together, compute it once.

In both worker modes, on the tiny random Llama (float32): the first request computes the shared
prefix, the others wait for its blocks and hit them (the engine's prefill token counter says
how much was computed), and every answer equals the one the same prompt gets alone on an engine
without prefix caching.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from deepinfer.config import Config, SchedulerConfig, WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from tests.engine.tiny_engine import GREEDY, run_all, tiny_config

PREFIX_TOKENS = 2048
TAIL_TOKENS = 5
NUM_REQUESTS = 8


@pytest.fixture(scope="module")
def long_tiny_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a context long enough for the shared prefix."""
    path = tmp_path_factory.mktemp("tiny-llama-long")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, path / f.name)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096}))
    return path


def prompts() -> list[list[int]]:
    prefix = [(j * 7919) % 30000 + 100 for j in range(PREFIX_TOKENS)]
    return [
        prefix + [(i * 131 + j * 17) % 30000 + 100 for j in range(TAIL_TOKENS)]
        for i in range(NUM_REQUESTS)
    ]


def config_for(model_dir: Path, colocated: bool, caching: bool = True) -> Config:
    base = tiny_config(model_dir, WorkersConfig(colocated=colocated), num_blocks=1536)
    return dataclasses.replace(
        base,
        cache=dataclasses.replace(base.cache, enable_prefix_caching=caching),
        # every prompt fits one step: without the wait, all eight would compute the prefix
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32768),
    )


async def alone(model_dir: Path, colocated: bool) -> list[list[int]]:
    async with AsyncEngine(config_for(model_dir, colocated, caching=False)) as engine:
        return [(await run_all(engine, [p]))[0] for p in prompts()]


@pytest.mark.slow
@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
async def test_shared_new_prefix_in_flight_is_computed_once(
    long_tiny_dir: Path, colocated: bool
) -> None:
    async with AsyncEngine(config_for(long_tiny_dir, colocated)) as engine:
        together = await run_all(engine, prompts(), GREEDY)
        counts = engine.stats().prefill_counts
    assert counts.num_computed_tokens == PREFIX_TOKENS + NUM_REQUESTS * TAIL_TOKENS
    assert counts.num_inflight_saved_tokens == (NUM_REQUESTS - 1) * PREFIX_TOKENS
    assert counts.num_inflight_waits == NUM_REQUESTS - 1
    assert together == await alone(long_tiny_dir, colocated)
