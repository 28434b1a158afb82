"""What `--batch-invariant` costs: the default mode against the batch-invariant one, engine only
(the embedding API), on SmolLM2, in one run.

Two engines, one per mode, both started at once; each measurement runs on one and then the
other within seconds (the order alternating from round to round), and the table gives the
medians over the rounds of each mode's figure and of their ratio:

- 1, 8 and 32 streams: clients that each send their next request as soon as the last one ended
  (`engine_load.closed_loop`), every prompt a new one (a chat question under a number no other
  request has, so every prompt is computed: the mode's cost is in computing prompts), 64 tokens
  a request, greedy; aggregate tokens/s over the window.
- TTFT of a long prompt (about 1,500 tokens, never seen before), alone.

    python bench/batch_invariant.py
    python bench/batch_invariant.py --rounds 5 --streams 1,8,32
    python bench/batch_invariant.py --device cuda    # the Triton path: fixed-order matmuls
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import time

import uvloop
from common import provenance
from engine_load import closed_loop

import deepinfer  # noqa: F401  (before torch: OpenMP's waits)
from deepinfer.config import CacheConfig, Config, DiskCacheConfig, ModelConfig, RuntimeConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.request import SamplingParams
from deepinfer.text.messages import ChatMessage

QUESTIONS = (
    "Write a short paragraph about the ocean.",
    "What makes a good cup of tea?",
    "Describe a lighthouse at night.",
    "Explain how a bicycle stays upright.",
    "Give three tips for learning a language.",
)
LONG = " ".join(f"Item {i}: the {w} rests on the shelf near the window." for i, w in
                zip(range(120), itertools.cycle(("lamp", "book", "vase", "clock", "plant"))))  # fmt: skip
"""About 1,500 tokens of text."""
MODES = ("default", "batch-invariant")


def _config(invariant: bool, device: str) -> Config:
    return Config(
        model=ModelConfig(batch_invariant=invariant),
        cache=CacheConfig(kv_memory_bytes=1 << 30),
        disk_cache=DiskCacheConfig(enabled=False),
        runtime=RuntimeConfig(device=device),
    )


class Fresh:
    """Prompts no engine has seen: a run-wide counter ahead of each question."""

    def __init__(self) -> None:
        self._n = itertools.count()

    def question(self, k: int) -> list[ChatMessage]:
        return [ChatMessage("user", f"Request {next(self._n)}. {QUESTIONS[k % len(QUESTIONS)]}")]

    def long(self) -> list[ChatMessage]:
        return [ChatMessage("user", f"Request {next(self._n)}. {LONG}\nWhich items are lamps?")]


async def ttft(engine: AsyncEngine, prompt: list[ChatMessage]) -> float:
    start = time.perf_counter()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    async with contextlib.aclosing(engine.generate(prompt, params)) as it:
        async for _ in it:
            break
    return time.perf_counter() - start


async def measure(engine: AsyncEngine, what: str, fresh: Fresh, max_tokens: int) -> float:
    if what == "ttft":
        return await ttft(engine, fresh.long())
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return await closed_loop(engine, fresh.question, params, int(what))


async def run(
    rounds: int, streams: list[int], max_tokens: int, device: str = "auto"
) -> dict[str, list[dict[str, float]]]:
    """Each measurement's figure per mode, per round."""
    measurements = [str(n) for n in streams] + ["ttft"]
    out: dict[str, list[dict[str, float]]] = {m: [] for m in measurements}
    fresh = Fresh()
    default_config, invariant_config = _config(False, device), _config(True, device)
    async with AsyncEngine(default_config) as default, AsyncEngine(invariant_config) as invariant:
        engines = {"default": default, "batch-invariant": invariant}
        for engine in engines.values():  # warm-up
            await ttft(engine, fresh.question(0))
        for r in range(rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for what in measurements:
                figures = {}
                for mode in order:
                    figures[mode] = await measure(engines[mode], what, fresh, max_tokens)
                out[what].append(figures)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", default="1,8,32", help="stream counts, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda")
    ns = ap.parse_args()
    started = provenance()
    streams = [int(n) for n in ns.streams.split(",")]
    results = uvloop.run(run(ns.rounds, streams, ns.max_tokens, ns.device))
    print(started)
    print()
    print("| measurement | default | batch-invariant | batch-invariant / default |")
    print("|---|---:|---:|---:|")
    for what, rounds in results.items():
        base = statistics.median(r["default"] for r in rounds)
        inv = statistics.median(r["batch-invariant"] for r in rounds)
        ratio = statistics.median(r["batch-invariant"] / r["default"] for r in rounds)
        if what == "ttft":
            print(f"| TTFT, ~1,500-token prompt (s) | {base:.2f} | {inv:.2f} | {ratio:.2f}x |")
        else:
            label = f"{what} stream{'s' if what != '1' else ''}, tok/s"
            print(f"| {label} | {base:.1f} | {inv:.1f} | {ratio:.2f}x |")
    print()
    print(f"Medians over {ns.rounds} rounds; the ratio is the median of each round's.")


if __name__ == "__main__":
    main()
