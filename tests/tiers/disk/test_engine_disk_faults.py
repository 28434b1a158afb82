"""A disk tier that fails inside `KVTiers.fill` (its lookup, its read, or copying its
payloads into the KV pool) costs the request its disk hit, never the request: the tiny random
Llama gives the same greedy tokens as without the cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.config import CacheConfig, Config, DiskCacheConfig, ModelConfig, SchedulerConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.types import Usage
from deepinfer.request import SamplingParams
from deepinfer.tiers.copies import TierCopies
from deepinfer.tiers.disk.tier import DiskTier

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [(j * 53) % 5000 + 100 for j in range(70)]  # four full blocks of 16, and a tail


def _config(model_dir: Path, cache_dir: Path) -> Config:
    return Config(
        model=ModelConfig(path=model_dir, dtype="float32"),
        cache=CacheConfig(num_blocks=64),
        disk_cache=DiskCacheConfig(enabled=True, cache_dir=cache_dir),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
    )


async def _generate(config: Config) -> tuple[list[int], Usage]:
    """One greedy run on a fresh engine (empty device pool: hits can only come from disk)."""
    tokens: list[int] = []
    async with AsyncEngine(config) as engine:
        async for out in engine.generate(PROMPT, GREEDY):
            tokens.extend(out.token_ids)
        assert out.usage is not None
        disk = engine.core.tiers.disk
        assert disk is not None and disk.flush(10)
        engine.check_integrity()
    return tokens, out.usage


def _raise(*args: object, **kwargs: object) -> object:
    raise RuntimeError("disk tier failure")


@pytest.mark.slow
async def test_disk_failure_costs_the_hit_not_the_request(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tiny_llama_dir, tmp_path / "cache")
    reference, cold = await _generate(config)
    assert cold.disk_cached_tokens == 0
    warm_tokens, warm = await _generate(config)
    assert warm_tokens == reference and warm.disk_cached_tokens >= 64, "no disk hit to lose"

    for owner, method in [
        (DiskTier, "contains_prefix"), (DiskTier, "load_async"), (TierCopies, "write")
    ]:  # fmt: skip
        with monkeypatch.context() as patch:
            patch.setattr(owner, method, _raise)
            tokens, usage = await _generate(config)
        assert tokens == reference, method
        assert usage.disk_cached_tokens == 0 and usage.cached_tokens == 0, method
