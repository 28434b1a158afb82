"""Real models against llama.cpp: a pulled Qwen2.5-Coder GGUF served by deepinfer (default flags)
and by llama-server on the same file, one engine after the other in the same run.

    deepinfer pull qwen2.5-coder-1.5b && python bench/real_models.py
    python bench/real_models.py --model qwen2.5-coder-0.5b --long 4096
    python bench/real_models.py --levels 1,16 --long '' --skip-llama     # a quick look

For each engine: start-up (process start to /health answering), RSS of the process tree once
healthy and `--settle-s` later (anonymous part beside: what the server wrote, without the pages
of the memory-mapped file), aggregate tokens/s of streaming chat clients at each level (one
request per client, `--max-tokens` tokens each, `ignore_eos`, greedy; prompts of a few dozen
tokens, distinct per client), the greedy completions of `--agreement` raw prompts (where they
differ from llama-server's, the gap between our two most likely tokens at the first difference:
a near-tie or not), then the TTFT of one long prompt of each `--long` size (a code file the
prefix cache has not seen, distinct per size; prefill tokens/s beside). llama-server runs as a
self-hoster would: as many slots as the largest level, one KV cache they share (`--kv-unified`)
large enough for the longest prompt, every core, continuous batching, `-nr` where the CPU lists
AMX. deepinfer runs with its default flags and a disk cache of its own (`--cache-dir`, removed
after): the disk tier would otherwise serve an earlier run's prompts. Prints and writes
bench/out/real_models-<model>.md (+ .json) with deepinfer / llama-server ratios against the
targets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from common import (
    ROOT,
    deepinfer_cmd,
    find_llama_server,
    free_port,
    llama_cmd,
    provenance,
    running_process,
)  # fmt: skip
from memory import tree_memory
from serve import Level, run_level

from deepinfer.environment import resolve_model

OUT = ROOT / "bench" / "out"

TARGETS = {"tok/s 1": 1.3, "tok/s 16": 3.0, "tok/s 64": 4.0}
"""deepinfer / llama-server at least these (throughput); the others are at most (below)."""
TARGETS_AT_MOST = {"TTFT 4096": 0.7, "start-up": 1.0, "RSS": 1.2}


AGREEMENT_PROMPTS = [
    "def fibonacci(n):",
    "# Quicksort in Python\n",
    "SELECT name, COUNT(*) FROM",
    "import numpy as np\n\n",
    "The capital of France is",
    "class Stack:\n    def __init__(self):",
    "fn main() {",
    "// A binary search in C\nint search(",
    "To reverse a linked list,",
    "#include <stdio.h>\n",
    "def is_prime(n):\n",
    "const express = require('express');\n",
    "<html>\n<head>",
    "The three laws of thermodynamics are",
    "async function fetchData(url) {",
    "def merge_sort(items):",
    "public class HelloWorld {",
    "git commit -m",
    "A hash map is",
    "for i in range(10):",
]
"""Twenty raw completion prompts for the greedy agreement check (`--agreement`)."""


@dataclass
class EngineRun:
    engine: str
    startup_s: float = 0.0
    rss_mb: float = 0.0
    anon_mb: float = 0.0
    levels: dict[int, dict[str, float]] = field(default_factory=dict)
    long: dict[int, dict[str, float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    greedy: list[list[str]] = field(default_factory=list)
    """Each agreement prompt's greedy tokens (as text pieces)."""
    top2: list[list[tuple[float, float]]] = field(default_factory=list)
    """deepinfer: at each of those tokens, the two largest log-probabilities."""


async def greedy_pieces(
    url: str, prompt: str, tokens: int
) -> tuple[list[str], list[tuple[float, float]]]:
    """The greedy continuation's tokens through /v1/completions (`logprobs` 2: the top two
    log-probabilities at each, where the server gives them)."""
    body = {"model": "default", "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
            "logprobs": 2}  # fmt: skip
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        resp = await client.post(f"{url}/v1/completions", json=body)
        resp.raise_for_status()
    lp = resp.json()["choices"][0].get("logprobs") or {}
    if "content" in lp:  # llama-server answers in the chat completions' shape
        return [str(c.get("token")) for c in lp["content"] or []], []
    pieces = list(lp.get("tokens") or [])
    top2 = []
    for top in lp.get("top_logprobs") or []:
        values = sorted((top or {}).values(), reverse=True) + [float("-inf")] * 2
        top2.append((float(values[0]), float(values[1])))
    return pieces, top2


def agreement(ours: EngineRun, peer: EngineRun) -> list[str]:
    """Per prompt: identical, or where the greedy tokens first differ and the gap between our
    two most likely tokens there (a near-tie when small)."""
    identical = 0
    lines = []
    gaps = []
    for i, (a, b) in enumerate(zip(ours.greedy, peer.greedy, strict=False)):
        if a == b:
            identical += 1
            continue
        at = next(
            (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        top = ours.top2[i][at] if at < len(ours.top2[i]) else (float("nan"), float("nan"))
        gap = top[0] - top[1]
        gaps.append(gap)
        lines.append(
            f"- prompt {i}: first differs at token {at}, our top-2 log-probability gap there {gap:.3f}"
        )
    head = f"- greedy agreement: {identical}/{len(ours.greedy)} prompts identical"
    if gaps:
        head += f"; at the divergences the gap is at most {max(gaps):.3f} (median {sorted(gaps)[len(gaps) // 2]:.3f})"
    return [head, *lines]


def code_prompt(tokens: int, seed: int) -> str:
    """About `tokens` tokens of Python-like source (roughly 3.3 characters a token for this
    tokenizer on such text), distinct per seed, and a request about it."""
    rng = random.Random(seed)
    words = ["value", "items", "index", "total", "buffer", "result", "count", "offset", "name",
             "config", "cache", "block", "stream", "token", "queue", "state", "limit", "batch"]  # fmt: skip
    lines = []
    chars = 0
    n = 0
    while chars < tokens * 3.3:
        a, b, c = rng.sample(words, 3)
        line = (
            f"def {a}_{b}_{n}({c}, {a}={rng.randint(0, 999)}):\n"
            f"    {b} = [{c} * {rng.randint(2, 97)} for {c} in range({a})]\n"
            f"    return sum({b}) + {rng.randint(0, 9999)}\n\n"
        )
        lines.append(line)
        chars += len(line)
        n += 1
    return "Here is a file:\n\n" + "".join(lines) + "\nSummarize what the last function does."


async def long_prompt_ttft(url: str, tokens: int, seed: int) -> dict[str, float]:
    body = {
        "model": "default", "stream": True, "max_tokens": 2, "temperature": 0.0,
        "messages": [{"role": "user", "content": code_prompt(tokens, seed)}],
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    first = None
    prompt_tokens = 0
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp,
    ):
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage")
            if usage:
                prompt_tokens = int(usage.get("prompt_tokens", 0))
            choices = chunk.get("choices") or []
            if first is None and choices and (choices[0].get("delta") or {}).get("content"):
                first = time.perf_counter()
    ttft = (first or time.perf_counter()) - start
    return {"ttft_s": ttft, "prompt_tokens": prompt_tokens, "prefill_tok_s": prompt_tokens / ttft}


def level_row(level: Level) -> dict[str, float]:
    row = level.row()
    return {k: float(v) for k, v in row.items() if isinstance(v, int | float)}


def measure(engine: str, cmd: list[str], port: int, ns: argparse.Namespace) -> EngineRun:
    run = EngineRun(engine)
    url = f"http://127.0.0.1:{port}"
    log = OUT / f"real_models-{engine}.log"
    start = time.perf_counter()
    with running_process(cmd, port, log) as (_base, proc):
        run.startup_s = time.perf_counter() - start
        time.sleep(ns.settle_s)
        mem = tree_memory(proc.pid)
        run.rss_mb, run.anon_mb = mem.rss_bytes / 2**20, mem.anon_bytes / 2**20
        print(f"{engine}: healthy in {run.startup_s:.1f} s, RSS {run.rss_mb:.0f} MB", flush=True)
        for c in ns.levels:
            level = asyncio.run(run_level(url, engine, c, 1, ns.max_tokens))
            run.levels[c] = level_row(level)
            run.errors += level.errors
            print(f"  {c:3d} streams: {run.levels[c]['tok_per_s']:.1f} tok/s", flush=True)
        for prompt in AGREEMENT_PROMPTS[: ns.agreement]:
            pieces, top2 = asyncio.run(greedy_pieces(url, prompt, ns.agreement_tokens))
            run.greedy.append(pieces)
            run.top2.append(top2)
        for i, tokens in enumerate(ns.long):
            run.long[tokens] = asyncio.run(long_prompt_ttft(url, tokens, seed=1000 + i))
            print(f"  {tokens}-token prompt: TTFT {run.long[tokens]['ttft_s']:.1f} s", flush=True)
    return run


def ratios(ours: EngineRun, peer: EngineRun) -> list[tuple[str, float, str]]:
    """(measure, deepinfer / llama-server, verdict)."""
    out: list[tuple[str, float, str]] = []
    for c, row in ours.levels.items():
        if c in peer.levels and peer.levels[c]["tok_per_s"]:
            value = row["tok_per_s"] / peer.levels[c]["tok_per_s"]
            target = TARGETS.get(f"tok/s {c}")
            verdict = "" if target is None else ("PASS" if value >= target else "FAIL")
            out.append((f"tok/s {c}", value, verdict + (f" (>= {target}x)" if target else "")))
    for tokens, row in ours.long.items():
        if tokens in peer.long:
            value = row["ttft_s"] / peer.long[tokens]["ttft_s"]
            target = TARGETS_AT_MOST.get(f"TTFT {tokens}")
            verdict = "" if target is None else ("PASS" if value <= target else "FAIL")
            out.append((f"TTFT {tokens}", value, verdict + (f" (<= {target}x)" if target else "")))
    for name, value in (
        ("start-up", ours.startup_s / peer.startup_s),
        ("RSS", ours.rss_mb / peer.rss_mb),
    ):
        target = TARGETS_AT_MOST[name]
        out.append((name, value, ("PASS" if value <= target else "FAIL") + f" (<= {target}x)"))
    return out


def report(model: str, runs: list[EngineRun]) -> str:
    lines = [f"### {model}", "", provenance(), ""]
    levels = sorted({c for r in runs for c in r.levels})
    head = "| engine | start-up s | RSS MB (anon) | " + " | ".join(f"{c} str tok/s" for c in levels)
    longs = sorted({t for r in runs for t in r.long})
    head += "".join(f" | {t} TTFT s (tok/s)" for t in longs) + " |"
    lines += [head, "|---" * (3 + len(levels) + len(longs)) + "|"]
    for r in runs:
        cells = [r.engine, f"{r.startup_s:.1f}", f"{r.rss_mb:.0f} ({r.anon_mb:.0f})"]
        cells += [f"{r.levels[c]['tok_per_s']:.1f}" if c in r.levels else "-" for c in levels]
        cells += [
            f"{r.long[t]['ttft_s']:.1f} ({r.long[t]['prefill_tok_s']:.0f})" if t in r.long else "-"
            for t in longs
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if len(runs) == 2:
        lines += ["", "| deepinfer / llama-server | ratio | target |", "|---|---|---|"]
        lines += [f"| {n} | {v:.2f}x | {verdict} |" for n, v, verdict in ratios(runs[0], runs[1])]
    if len(runs) == 2 and runs[0].greedy and runs[1].greedy:
        lines += ["", *agreement(runs[0], runs[1])]
    errors = [e for r in runs for e in r.errors]
    if errors:
        lines += ["", f"errors: {len(errors)}, first: {errors[0]}"]
    return "\n".join(lines)


def llama_server_cmd(binary: Path, model: Path, port: int, slots: int, ctx: int) -> list[str]:
    """`llama_cmd` with one KV cache of at least `ctx` tokens that all slots share."""
    return [*llama_cmd(binary, model, port, slots, -(-ctx // slots)), "--kv-unified"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a pulled name or a GGUF path")
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--long", default="4096,16384", help="long-prompt sizes ('' for none)")
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--agreement", type=int, default=20, help="greedy agreement prompts (<= 20)")
    ap.add_argument("--agreement-tokens", type=int, default=32)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--deepinfer-args", default="", help="extra flags for server.py")
    ns = ap.parse_args()
    ns.levels = [int(x) for x in ns.levels.split(",") if x]
    ns.long = [int(x) for x in ns.long.split(",") if x]
    model = resolve_model(Path(ns.model))
    if not model.is_file():
        raise SystemExit(f"no model file for {ns.model!r}: run `deepinfer pull {ns.model}`")
    OUT.mkdir(parents=True, exist_ok=True)
    runs = []
    port = free_port()
    # The disk tier keeps prefixes across restarts: a cache of its own makes every prompt of
    # this run new to deepinfer, as to llama-server (whose prompt cache dies with it).
    cache_dir = Path(tempfile.mkdtemp(prefix="real-models-cache-"))
    extra = ["--model", str(model), "--cache-dir", str(cache_dir), *ns.deepinfer_args.split()]
    try:
        runs.append(measure("deepinfer", deepinfer_cmd(port, extra), port, ns))
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    binary = find_llama_server()
    if ns.skip_llama or binary is None:
        print(
            "llama-server: skipped"
            + (
                ""
                if ns.skip_llama
                else " (not found: set $LLAMA_SERVER or build it under third_party/)"
            )
        )
    else:
        port = free_port()
        ctx = max([*ns.long, 0]) + 2 * ns.max_tokens * max(ns.levels) + 1024
        cmd = llama_server_cmd(binary, model, port, max(ns.levels), ctx)
        runs.append(measure("llama-server", cmd, port, ns))
    text = report(model.stem, runs)
    print(text)
    stem = f"real_models-{model.stem}"
    (OUT / f"{stem}.md").write_text(text + "\n")
    (OUT / f"{stem}.json").write_text(json.dumps([asdict(r) for r in runs], indent=1))


if __name__ == "__main__":
    main()
