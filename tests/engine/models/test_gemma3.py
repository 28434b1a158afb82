"""Gemma 3 270M through the engine: its sliding-window layers behind the prefix cache. Greedy
answers to prompts past two windows are the same computed cold (no prefix cache), from the
device cache, sharing a cached prefix with another prompt, and from the disk tier after a
restart; the pool is intact after each run."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from deepinfer.config import CacheConfig, Config, DiskCacheConfig, ModelConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.types import Usage
from deepinfer.environment import default_model_dir
from deepinfer.request import SamplingParams

GEMMA3 = default_model_dir() / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not GEMMA3.is_file(), reason="run `deepinfer pull gemma3-270m`"),
]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def _agent_log(seed: int, steps: int) -> str:
    rng = random.Random(seed)
    tools = ["search", "read", "write", "run"]
    return "".join(
        f"Step {i}: call {rng.choice(tools)}(item={rng.randrange(1000)}) -> "
        f"status {rng.choice(['ok', 'retry', 'done'])}, {rng.randrange(99)} results.\n"
        for i in range(steps)
    )


PREFIX = "An agent's log.\n" + _agent_log(0, 48)  # about 1,400 tokens: past two 512-token windows
PROMPTS = [PREFIX + "Step 48: call", PREFIX + "Summary of the log:", PREFIX + "Step 48: call"]


def _config(cache_dir: Path, *, prefix_caching: bool = True, disk: bool = False) -> Config:
    return Config(
        model=ModelConfig(path=GEMMA3, dtype="float32", matmul_activations="float32"),
        cache=CacheConfig(num_blocks=512, enable_prefix_caching=prefix_caching),
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


async def test_cache_hits_never_change_answers(tmp_path: Path) -> None:
    cold, cold_usage = await _run(_config(tmp_path / "off", prefix_caching=False))
    assert min(u.prompt_tokens for u in cold_usage) > 1024
    assert all(u.cached_tokens == 0 for u in cold_usage)
    assert cold[0] == cold[2] and len(cold[0]) == 12

    warm, usage = await _run(_config(tmp_path / "disk", disk=True))
    assert warm == cold
    shared = usage[0].prompt_tokens - 32
    assert usage[1].cached_tokens >= shared  # the shared prefix, from the device cache
    assert usage[2].cached_tokens >= usage[2].prompt_tokens - 16  # the whole prompt again

    restarted, usage = await _run(_config(tmp_path / "disk", disk=True))
    assert restarted == cold
    # the disk tier holds the full layers' blocks, and the windowed layers' window before the
    # first run's prompt end: the same prompt resumes there, nothing replayed
    assert usage[0].disk_cached_tokens >= usage[0].prompt_tokens - 32
