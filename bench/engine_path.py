"""The serving path without HTTP: tokens/s the engine alone streams to N in-process readers.

`AsyncEngine` on the null model (`--model null`: the default model's tokenizer and chat format
over a forward pass that costs nothing), N concurrent `generate` calls of `--max-tokens` greedy
tokens each, read as an application embedding the engine reads them. Set beside
`bench/serving_path.py` (the same engine behind the HTTP server and SSE clients), the difference
is what the API, the frames and the sockets cost; this one is the scheduler, the workers, the
sampler and the streams alone. Reported per run: tokens/s and the process's CPU time per token.

Run from the repository root:

    python bench/engine_path.py
    python bench/engine_path.py --streams 32 256 --repeats 3
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


async def one(engine: AsyncEngine, prompt: str, params: SamplingParams) -> int:
    tokens = 0
    async for out in engine.generate(prompt, params):
        tokens += len(out.token_ids)
    return tokens


async def level(engine: AsyncEngine, streams: int, params: SamplingParams) -> tuple[float, float]:
    """(tokens/s, CPU us per token) of `streams` concurrent requests."""
    start, cpu0 = time.perf_counter(), time.process_time()
    prompts = [f"Tell me a long story, number {i}." for i in range(streams)]
    tokens = sum(await asyncio.gather(*(one(engine, p, params) for p in prompts)))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    return tokens / wall, 1e6 * cpu / tokens


async def main(ns: argparse.Namespace) -> None:
    config = Config(
        model=ModelConfig(path=Path("null")),
        cache=CacheConfig(kv_memory_bytes=1 << 30),
        disk_cache=DiskCacheConfig(enabled=False),
        scheduler=SchedulerConfig(max_num_seqs=max(ns.streams), max_waiting=4096),
    )
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=0.0, ignore_eos=True)
    print(f"\n### Engine path, null model: `bench/engine_path.py`\n\n{provenance()}\n")
    print("| streams | tok/s | CPU us/token |")
    print("|---|---|---|")
    async with AsyncEngine(config) as engine:
        await level(engine, 8, params)  # warm up: what is lazy is built
        for streams in ns.streams:
            runs = [await level(engine, streams, params) for _ in range(ns.repeats)]
            rate, cpu = (statistics.median(v) for v in zip(*runs, strict=True))
            print(f"| {streams} | {rate:.0f} | {cpu:.1f} |", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[32, 128, 256])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="runs per level (median)")
    uvloop.run(main(ap.parse_args()))
