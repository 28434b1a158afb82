"""Speculative decoding against plain decoding, engine only (the embedding API, no HTTP), on
SmolLM2 with greedy requests, three workloads:

- agent: a tool-using session's turn that quotes and edits a file from its context (the model
  rewrites a ~30-line file with one change);
- code: completing a Python module from its first functions;
- chat: open questions (serve.py's kind of prompt).

For each method (`none`, each proposer) a fresh engine runs every workload one request at a time
(single stream: decode tokens/s from the first token to the last) and 8 at once (aggregate
tokens/s), and reports drafted and accepted tokens and the mean accepted run. The outputs of
every method are checked equal to plain decoding's, token for token.

    python bench/speculative.py
    python bench/speculative.py --methods none,ngram,ngram:off --max-tokens 128 --streams 8

A method is a proposer with the confidence gate on (`ngram`) or off (`ngram:off`: every draft
verified).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time

import uvloop
from common import provenance

import deepinfer  # noqa: F401  (before torch: OpenMP's waits)
from deepinfer.config import Config, DiskCacheConfig, SpeculativeConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.request import SamplingParams
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
WORKLOADS = {"agent": AGENT, "code": CODE, "chat": CHAT}


@dataclasses.dataclass
class Run:
    tokens: list[list[int]]
    single_tok_s: float
    multi_tok_s: float


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


async def run_workload(engine: AsyncEngine, prompts: list, max_tokens: int, streams: int) -> Run:
    tokens, decode_s, decoded = [], 0.0, 0
    for prompt in prompts:  # one stream
        ids, first, last = await one(engine, prompt, max_tokens)
        tokens.append(ids)
        decode_s += last - first
        decoded += len(ids) - 1
    batch = [prompts[i % len(prompts)] for i in range(streams)]
    start = time.perf_counter()
    outs = await asyncio.gather(*(one(engine, p, max_tokens) for p in batch))
    wall = time.perf_counter() - start
    return Run(tokens, decoded / decode_s, sum(len(ids) for ids, _, _ in outs) / wall)


async def run_method(
    method: str, max_tokens: int, streams: int
) -> tuple[dict[str, Run], dict[str, tuple[int, int, int]]]:
    name, _, gate = method.partition(":")
    config = Config(
        disk_cache=DiskCacheConfig(enabled=False),
        speculative=SpeculativeConfig(speculative=name, speculative_gate=gate or "on"),
    )
    runs, counts = {}, {}
    async with AsyncEngine(config) as engine:
        await one(engine, CHAT[0], 8)  # warm-up
        for name, prompts in WORKLOADS.items():
            before = engine.stats().speculative
            runs[name] = await run_workload(engine, prompts, max_tokens, streams)
            after = engine.stats().speculative
            counts[name] = (
                after.num_drafted - before.num_drafted,
                after.num_accepted - before.num_accepted,
                after.num_verified - before.num_verified,
            )
    return runs, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--methods", default="none,ngram,ngram:off")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=8)
    ns = ap.parse_args()
    methods = ns.methods.split(",")
    results = {m: uvloop.run(run_method(m, ns.max_tokens, ns.streams)) for m in methods}
    plain = results.get("none")
    print(provenance())
    print()
    print(
        f"| workload | method | 1 stream tok/s | vs plain | {ns.streams} streams tok/s | vs plain | drafted | accepted | mean accepted run | same tokens |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name in WORKLOADS:
        for m in methods:
            runs, counts = results[m]
            r, (drafted, accepted, verified) = runs[name], counts[name]
            base = plain[0][name] if plain else r
            same = "yes" if r.tokens == base.tokens else "NO"
            mean_run = f"{accepted / verified:.2f}" if verified else "-"
            print(
                f"| {name} | {m} | {r.single_tok_s:.1f} | {r.single_tok_s / base.single_tok_s:.2f}x | "
                f"{r.multi_tok_s:.1f} | {r.multi_tok_s / base.multi_tok_s:.2f}x | {drafted} | "
                f"{accepted} | {mean_run} | {same} |"
            )


if __name__ == "__main__":
    main()
