"""The serving path without HTTP: tokens/s the engine alone streams to N in-process readers.

`AsyncEngine` on the null model (`--model null`: the default model's tokenizer and chat format
over a forward pass that costs nothing), N concurrent `generate` calls of `--max-tokens` greedy
tokens each, read as an application embedding the engine reads them. Set beside
`bench/serving_path.py` (the same engine behind the HTTP server and SSE clients), the difference
is what the API, the frames and the sockets cost; this one is the scheduler, the workers, the
sampler and the streams alone. Reported per run: tokens/s and the process's CPU time per token.
With `--context N`, each prompt is about N tokens long and the rate is the decode rate: tokens
read while every stream is past its first token, over that span (the long prefills left out).

Run from the repository root:

    python bench/engine_path.py
    python bench/engine_path.py --streams 32 256 --repeats 3
    python bench/engine_path.py --streams 256 --context 4096
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import uvloop
from common import provenance

from deepinfer.config import CacheConfig, Config, DiskCacheConfig, ModelConfig, SchedulerConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.request import SamplingParams


async def one(engine: AsyncEngine, prompt: str, params: SamplingParams) -> list[tuple[float, int]]:
    """(arrival time, tokens) of each output read."""
    arrivals = []
    async for out in engine.generate(prompt, params):
        arrivals.append((time.perf_counter(), len(out.token_ids)))
    return arrivals


async def level(
    engine: AsyncEngine, streams: int, params: SamplingParams, context: int
) -> tuple[float, float]:
    """(tokens/s, CPU us per token) of `streams` concurrent requests; with a `context`, the
    rate while every stream decodes."""
    start, cpu0 = time.perf_counter(), time.process_time()
    filler = " and then the story went on" * (context // 6)
    prompts = [f"Tell me a long story, number {i}.{filler}" for i in range(streams)]
    reads = await asyncio.gather(*(one(engine, p, params) for p in prompts))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    tokens = sum(n for r in reads for _, n in r)
    if not context:
        return tokens / wall, 1e6 * cpu / tokens
    lo, hi = max(r[0][0] for r in reads), min(r[-1][0] for r in reads)
    decoded = sum(n for r in reads for t, n in r if lo < t <= hi)
    return decoded / (hi - lo), 1e6 * cpu / tokens


async def main(ns: argparse.Namespace) -> None:
    config = Config(
        model=ModelConfig(path=Path("null")),
        cache=CacheConfig(kv_memory_bytes=(1 << 30) * (1 + ns.context // 1024)),
        disk_cache=DiskCacheConfig(enabled=False),
        scheduler=SchedulerConfig(max_num_seqs=max(ns.streams), max_waiting=4096),
    )
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=0.0, ignore_eos=True)
    print(f"\n### Engine path, null model: `bench/engine_path.py`\n\n{provenance()}\n")
    if ns.context:
        print(f"Prompts of about {ns.context} tokens; tok/s while every stream decodes.\n")
    print("| streams | tok/s | CPU us/token |")
    print("|---|---|---|")
    async with AsyncEngine(config) as engine:
        await level(engine, 8, params, 0)  # warm up: what is lazy is built
        for streams in ns.streams:
            runs = [await level(engine, streams, params, ns.context) for _ in range(ns.repeats)]
            rate, cpu = (statistics.median(v) for v in zip(*runs, strict=True))
            print(f"| {streams} | {rate:.0f} | {cpu:.1f} |", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[32, 128, 256])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="runs per level (median)")
    ap.add_argument("--context", type=int, default=0, help="prompt tokens (about); 0: short")
    uvloop.run(main(ap.parse_args()))
