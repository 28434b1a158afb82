"""Speculative decoding against plain decoding, engine only (the embedding API, no HTTP), on
SmolLM2 with greedy requests, four workloads:

- agent: a tool-using session's turn that quotes and edits a file from its context (the model
  rewrites a ~30-line file with one change);
- code: completing a Python module from its first functions;
- chat: open questions (serve.py's kind of prompt);
- mixed: all nine prompts of the three, run only with several streams.

For each method (`none`, each proposer) a fresh engine runs every workload one request at a time
(single stream: decode tokens/s from the first token to the last) and then 8 and 32 at once
(aggregate tokens/s), and reports drafted and accepted tokens and the mean accepted run. Every
method runs once per round (`--rounds`): the ratios to plain decoding are each round's, and the
table gives their medians (the machine drifts between rounds; within one, methods follow each
other closely). The single-stream outputs of every method are checked equal to plain
decoding's, token for token.

    python bench/speculative.py
    python bench/speculative.py --methods none,ngram,ngram:off,layers --max-tokens 128 --streams 8,32

A method is a proposer with the confidence gate on (`ngram`, `layers`) or off (`ngram:off`:
every draft verified).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time

import uvloop
from common import provenance

import deepinfer  # noqa: F401  (before torch: OpenMP's waits)
from deepinfer.config import Config, DiskCacheConfig, SpeculativeConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.request import SamplingParams
from deepinfer.scheduler.speculative import SpeculativeCounts
from deepinfer.text.messages import ChatMessage

FILE = '''import json
from pathlib import Path


def load_config(path):
    """Read a JSON config file."""
    with open(path) as f:
        return json.load(f)


def save_config(path, config):
    """Write a config back as JSON."""
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def merge(base, override):
    """A copy of base with override's keys on top."""
    out = dict(base)
    for key, value in override.items():
        out[key] = value
    return out


def config_files(folder):
    """Every JSON file in a folder."""
    return sorted(Path(folder).glob("*.json"))
'''

AGENT = [
    [
        ChatMessage(
            "system", "You are a coding agent. You edit files and answer with the whole file."
        ),
        ChatMessage("user", f"This is config.py:\n```python\n{FILE}```\n{task}"),
    ]
    for task in (
        "Rename the function merge to merge_configs and output the whole file.",
        "Add a docstring line 'Config helpers.' at the top and output the whole file.",
        "Change indent=2 to indent=4 and output the whole file.",
    )
]
CODE = [
    [
        ChatMessage(
            "user", f"Continue this module with two more helper functions:\n```python\n{FILE[:420]}"
        )
    ],
    [ChatMessage("user", "Write a Python class Stack with push, pop, peek and is_empty methods.")],
    [ChatMessage("user", "Write a Python function that parses 'key=value' lines into a dict.")],
]
CHAT = [
    [ChatMessage("user", "Write a short paragraph about the ocean, then list 4 facts about rain.")],
    [ChatMessage("user", "What makes a good cup of tea? Answer in a few sentences.")],
    [ChatMessage("user", "Describe a lighthouse at night for a children's story.")],
]
WORKLOADS = {"agent": AGENT, "code": CODE, "chat": CHAT, "mixed": AGENT + CODE + CHAT}
"""`mixed` runs only with several streams: every prompt of the others, in turn."""


@dataclasses.dataclass
class Run:
    tokens: list[list[int]]
    """The single-stream outputs, in prompt order (checked against plain decoding)."""
    single_tok_s: float
    multi_tok_s: dict[int, float]
    """Aggregate tokens/s by number of streams."""


Counts = tuple[int, int, int]
"""Drafted, accepted, and request-steps that verified drafts."""


async def one(
    engine: AsyncEngine, prompt: list[ChatMessage], max_tokens: int
) -> tuple[list[int], float, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ids: list[int] = []
    first = last = 0.0
    async for out in engine.generate(prompt, params):
        now = time.perf_counter()
        first = first or now
        last = now
        ids.extend(out.token_ids)
    return ids, first, last


async def single_stream(engine: AsyncEngine, prompts: list, max_tokens: int) -> tuple[list, float]:
    tokens, decode_s, decoded = [], 0.0, 0
    for prompt in prompts:
        ids, first, last = await one(engine, prompt, max_tokens)
        tokens.append(ids)
        decode_s += last - first
        decoded += len(ids) - 1
    return tokens, decoded / decode_s


async def many_streams(engine: AsyncEngine, prompts: list, max_tokens: int, streams: int) -> float:
    batch = [prompts[i % len(prompts)] for i in range(streams)]
    start = time.perf_counter()
    outs = await asyncio.gather(*(one(engine, p, max_tokens) for p in batch))
    return sum(len(ids) for ids, _, _ in outs) / (time.perf_counter() - start)


def _delta(before: SpeculativeCounts, after: SpeculativeCounts) -> Counts:
    return (
        after.num_drafted - before.num_drafted,
        after.num_accepted - before.num_accepted,
        after.num_verified - before.num_verified,
    )


async def run_method(
    method: str, max_tokens: int, streams: list[int]
) -> tuple[dict[str, Run], dict[str, Counts]]:
    """One engine with the method: every workload single-stream, then at each stream count
    (the mixed workload only there); the speculative counts of each workload's runs."""
    name, _, gate = method.partition(":")
    config = Config(
        disk_cache=DiskCacheConfig(enabled=False),
        speculative=SpeculativeConfig(speculative=name, speculative_gate=gate or "on"),
    )
    runs, counts = {}, {}
    async with AsyncEngine(config) as engine:
        await one(engine, CHAT[0], 8)  # warm-up
        for workload, prompts in WORKLOADS.items():
            before = engine.stats().speculative
            tokens, single = [], 0.0
            if workload != "mixed":
                tokens, single = await single_stream(engine, prompts, max_tokens)
            multi = {n: await many_streams(engine, prompts, max_tokens, n) for n in streams}
            runs[workload] = Run(tokens, single, multi)
            counts[workload] = _delta(before, engine.stats().speculative)
    return runs, counts


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--methods", default="none,ngram,ngram:off,layers")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--streams", default="8,32", help="stream counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="every method once per round")
    ns = ap.parse_args()
    started = provenance()  # the code that runs is the tree at the start
    methods = ns.methods.split(",")
    streams = [int(n) for n in ns.streams.split(",")]
    rounds = [
        {m: uvloop.run(run_method(m, ns.max_tokens, streams)) for m in methods}
        for _ in range(ns.rounds)
    ]
    print(started)
    print()
    multi_cols = " | ".join(f"{n} streams tok/s | vs plain" for n in streams)
    print(
        f"| workload | method | 1 stream tok/s | vs plain | {multi_cols} | drafted | accepted "
        "| mean accepted run | same tokens |"
    )
    print("|---|---|---:|---:|" + "---:|---:|" * len(streams) + "---:|---:|---:|---|")
    for workload in WORKLOADS:
        for m in methods:
            print(_row(workload, m, rounds, streams))
    print()
    print(f"Ratios are medians over {ns.rounds} rounds of each round's ratio to plain decoding.")


def _row(workload: str, method: str, rounds: list, streams: list[int]) -> str:
    runs = [r[method][0][workload] for r in rounds]
    plains = [
        r["none"][0][workload] if "none" in r else run for r, run in zip(rounds, runs, strict=False)
    ]
    drafted, accepted, verified = (sum(r[method][1][workload][i] for r in rounds) for i in range(3))
    same = all(run.tokens == plain.tokens for run, plain in zip(runs, plains, strict=False))
    cells = [f"| {workload} | {method} "]
    if workload == "mixed":
        cells.append("| - | - ")
    else:
        single = _median([run.single_tok_s for run in runs])
        ratio = _median(
            [run.single_tok_s / p.single_tok_s for run, p in zip(runs, plains, strict=False)]
        )
        cells.append(f"| {single:.1f} | {ratio:.2f}x ")
    for n in streams:
        tok_s = _median([run.multi_tok_s[n] for run in runs])
        ratio = _median(
            [run.multi_tok_s[n] / p.multi_tok_s[n] for run, p in zip(runs, plains, strict=False)]
        )
        cells.append(f"| {tok_s:.1f} | {ratio:.2f}x ")
    mean_run = f"{accepted / verified:.2f}" if verified else "-"
    cells.append(f"| {drafted} | {accepted} | {mean_run} | {'yes' if same else 'NO'} |")
    return "".join(cells)


if __name__ == "__main__":
    main()
