"""Prefill and decode apart, on the real model: a long prompt does not stall 8 streams.

One engine in the default (disaggregated) mode: a decode worker and a prefill worker, one CPU
thread each. Eight greedy streams are decoding when a 640-token prompt arrives (prefill chunks of
at most 128 tokens). Until its first token the decode worker keeps stepping: every stream
receives more tokens than the prompt took prefill steps, which a colocated engine (one mixed step
per chunk, one token per stream per step) cannot give. Counts, not times: the latency figures
(inter-token p99 during a long prefill against the baseline; 60x colocated) are
bench/interference.py's (bench/RESULTS.md), and the cost model's accuracy on a busy machine is
no unit test's (its fit is tested on synthetic steps in
tests/scheduler/prefill/test_prefill_cost_model.py).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable

import pytest

from deepinfer.config import CacheConfig, Config, SchedulerConfig, WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.types import EngineStats
from deepinfer.request import SamplingParams

pytestmark = pytest.mark.slow

NUM_STREAMS = 8
LONG_PROMPT_TOKENS = 640


async def _stream(engine: AsyncEngine, i: int, counts: list[int]) -> None:
    """Streams until cancelled, counting tokens in `counts[i]` (a GPU decodes a whole request
    before the long prompt arrives: then the next one starts)."""
    params = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
    for turn in itertools.count():
        prompt = f"Stream {i}, part {turn}: tell a long story about a lighthouse."
        async for out in engine.generate(prompt, params):
            counts[i] += len(out.token_ids)


def _steps(stats: EngineStats) -> dict[str, int]:
    return {w.name: w.num_steps for w in stats.workers}


async def _until(condition: Callable[[], bool], timeout_s: float = 300.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def test_long_prompt_does_not_stall_streams() -> None:
    config = Config(
        cache=CacheConfig(num_blocks=1200),
        scheduler=SchedulerConfig(max_num_seqs=16),
        # chunks of at most 128 tokens: the prompt takes several prefill steps, whatever the
        # cost model (still learning) predicts
        workers=WorkersConfig(prefill_threads=1, decode_threads=1, prefill_max_batched_tokens=128),
    )
    rng = random.Random(0)
    async with AsyncEngine(config) as engine:
        vocab = engine.tokenizer.vocab_size
        long_ids = [rng.randrange(100, vocab) for _ in range(LONG_PROMPT_TOKENS)]
        counts = [0] * NUM_STREAMS
        streams = [asyncio.create_task(_stream(engine, i, counts)) for i in range(NUM_STREAMS)]
        try:
            await _until(lambda: min(counts) >= 2)  # every stream is decoding
            before, counts_before = _steps(engine.stats()), list(counts)
            params = SamplingParams(max_tokens=1, temperature=0.0)
            async for _ in engine.generate(long_ids, params):
                break
            stats = engine.stats()
            during = [n - m for n, m in zip(counts, counts_before, strict=True)]
        finally:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    steps = {name: n - before[name] for name, n in _steps(stats).items()}
    assert stats.prefill is not None
    print(
        f"while the long prompt prefilled: steps {steps}, tokens per stream {during}; cost model "
        f"error {stats.prefill.mean_abs_rel_error:.2f} over {stats.prefill.num_steps_observed}"
    )
    assert set(steps) == {"prefill", "decode"}
    assert steps["prefill"] >= 2, "the prompt was not chunked: nothing to interleave with"
    assert min(during) > 2 * steps["prefill"], "streams stalled behind the prefill"
    assert stats.prefill.num_steps_observed >= steps["prefill"], "the planner missed steps"
