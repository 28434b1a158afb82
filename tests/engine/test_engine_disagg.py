"""Prefill and decode apart, on the real model: a 6k-token prompt does not stall 8 streams.

One engine in the default (disaggregated) mode: a decode worker and a prefill worker, one CPU
thread each. Eight greedy streams run alone for a while (the baseline), then a 6k-token prompt
arrives; until its first token, the streams' inter-token latency p99 must stay close to the
baseline's (the benchmark, bench/interference.py, has the exact figures; the bound here is loose
for noisy CI machines). Colocated, the same prompt stalls every stream for whole seconds per step.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time

import pytest

from deepinfer.config import CacheConfig, Config, ModelConfig, SchedulerConfig, WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.request import SamplingParams

pytestmark = pytest.mark.slow

BASELINE_S = 6.0
LONG_PROMPT_TOKENS = 6000
ITL_P99_BOUND = 6.0
"""Loose, for noisy CI machines. The benchmark's criterion is 1.5x (bench/RESULTS.md); on a
2-core machine the prefill thread slows decode steps through the shared cores and memory bus,
and this test measured 3.6x before the native kernels (bench/interference.py then, with 16
streams: 1.87x). The colocated engine stalls every stream for each whole prefill chunk (60x in
the benchmark), so the bound still tells the two apart."""


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


async def _stream(engine: AsyncEngine, i: int, arrivals: list[list[float]]) -> None:
    """Streams until cancelled: a GPU decodes 600 tokens in seconds, before the long prompt."""
    params = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
    for turn in itertools.count():
        prompt = f"Stream {i}, part {turn}: tell a long story about a lighthouse."
        times: list[float] = []  # one list per request: a new request's prefill is no ITL gap
        arrivals.append(times)
        async for out in engine.generate(prompt, params):
            if out.token_ids:
                times.append(time.monotonic())


def _gaps(arrivals: list[list[float]], start: float, end: float) -> list[float]:
    return [
        b - a for times in arrivals for a, b in itertools.pairwise(times) if start <= a and b <= end
    ]


async def test_long_prompt_does_not_stall_streams() -> None:
    config = Config(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(num_blocks=1200),
        scheduler=SchedulerConfig(max_num_seqs=16),
        workers=WorkersConfig(prefill_threads=1, decode_threads=1),
    )
    rng = random.Random(0)
    async with AsyncEngine(config) as engine:
        vocab = engine.tokenizer.vocab_size
        long_ids = [rng.randrange(100, vocab) for _ in range(LONG_PROMPT_TOKENS)]
        arrivals: list[list[float]] = []
        streams = [asyncio.create_task(_stream(engine, i, arrivals)) for i in range(8)]
        try:
            await asyncio.sleep(BASELINE_S)
            t_long = time.monotonic()
            params = SamplingParams(max_tokens=1, temperature=0.0)
            async for _ in engine.generate(long_ids, params):
                break
            t_first = time.monotonic()
            stats = engine.stats()
        finally:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    baseline = _gaps(arrivals, t_long - BASELINE_S + 2.0, t_long)
    during = _gaps(arrivals, t_long, t_first)
    # a GPU prefills the prompt in well under a second: fewer gaps fall inside it than on CPU
    assert len(baseline) > 40 and len(during) > 40, (len(baseline), len(during))
    ratio = _p99(during) / _p99(baseline)
    print(
        f"ITL p99 baseline {_p99(baseline) * 1e3:.0f} ms, during the 6k prefill "
        f"{_p99(during) * 1e3:.0f} ms ({ratio:.2f}x); long prompt TTFT {t_first - t_long:.1f} s"
    )
    assert ratio <= ITL_P99_BOUND
    assert {w.name for w in stats.workers} == {"prefill", "decode"}
    assert stats.prefill is not None and stats.prefill.num_steps_observed > 5
    assert stats.prefill.mean_abs_rel_error < 0.5, "the cost model did not learn the step time"
