"""The engine on the real SmolLM2 with int8 activations (`--matmul-activations int8`): each row is
quantized alone and each output summed in one order, so a request's tokens do not depend on
what it is batched with, in decode steps and in mixed (colocated) ones alike.

The prefix cache is off here: with int8, a prompt whose prefix is served from the cache may
decode differently from the same prompt computed whole (the rounding magnifies the last-bit
difference of the chunk's attention; see bench/RESULTS.md)."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer.config import CacheConfig, DiskCacheConfig, ModelConfig, WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.kernels.native.cpu_native import native_available
from deepinfer.request import SamplingParams
from deepinfer.text.recipe import ChatMessage
from tests.engine.conftest import real_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not native_available(), reason="no native CPU kernels here"),
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


async def _ids(engine: AsyncEngine, prompt: list[ChatMessage]) -> list[int]:
    return [t async for out in engine.generate(prompt, GREEDY) for t in out.token_ids]


@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
async def test_int8_tokens_do_not_depend_on_the_batch(colocated: bool) -> None:
    config = real_config().replace(
        model=ModelConfig(dtype="float32", matmul_activations="int8"),
        workers=WorkersConfig(colocated=colocated, lend_idle_threads=True),
        # no prefix cache: the batched run must compute the prompts as the lone runs did
        cache=CacheConfig(num_blocks=512, enable_prefix_caching=False),
        disk_cache=DiskCacheConfig(enabled=False),
    )
    prompts = [
        [ChatMessage("user", f"Name {n} animals that live in the sea.")] for n in range(2, 8)
    ]
    async with AsyncEngine(config) as engine:
        assert engine.info.int8_activations and engine.info.quantized_bytes > 0
        alone = [await _ids(engine, p) for p in prompts]
        together = await asyncio.gather(*(_ids(engine, p) for p in prompts))
        engine.check_integrity()
    assert list(together) == alone
    assert all(len(ids) == 16 for ids in alone)
