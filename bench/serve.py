"""Serving benchmark: a concurrency sweep of streaming chat clients against deepinfer and, in the
same run, llama.cpp's llama-server (and ik_llama.cpp's, where built) on the same GGUF with as
many parallel slots.

    python bench/serve.py --levels 1,2,4,8,16,32,64 --requests-per-client 2 --max-tokens 64

Reports TTFT and inter-token latency p50/p99 and aggregate generated tokens/s per level, writes a
markdown table (bench/out/serve.md) and a PNG plot (bench/out/serve.png). For deepinfer it also
reports where a token's time goes: the mean step time of each worker during the level (from
/metrics: busy seconds over steps), beside the ITL the clients see; the rest is the path from the
step to the socket (scheduling, detokenization, SSE) and waiting.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from common import (
    ROOT,
    deepinfer_cmd,
    find_ik_llama_server,
    find_llama_server,
    free_port,
    llama_cmd,
    percentile,
    running,
)  # fmt: skip

OUT = ROOT / "bench" / "out"
TOPICS = ["the ocean", "volcanoes", "a lighthouse", "bread", "the moon", "trains", "chess",
          "rain", "honeybees", "a library", "glaciers", "jazz", "bicycles", "deserts"]  # fmt: skip


@dataclass
class Sample:
    ttft_s: float
    itl_s: list[float]
    tokens: int


@dataclass
class Level:
    engine: str
    concurrency: int
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    step_ms: dict[str, float] = field(default_factory=dict)
    """deepinfer: each worker's mean step time during the level (busy seconds over steps)."""

    def row(self) -> dict[str, float | int | str]:
        itl = [x for s in self.samples for x in s.itl_s]
        ttft = [s.ttft_s for s in self.samples]
        tokens = sum(s.tokens for s in self.samples)
        return {
            "engine": self.engine, "concurrency": self.concurrency,
            "requests": len(self.samples), "errors": len(self.errors), "tokens": tokens,
            "tok_per_s": tokens / self.wall_s if self.wall_s else 0.0,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
            "step_ms": " ".join(f"{k} {v:.1f}" for k, v in sorted(self.step_ms.items())) or "-",
        }  # fmt: skip


def workload(n: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    return [
        [{"role": "user", "content": f"Write a short paragraph about {rng.choice(TOPICS)}, "
          f"then list {rng.randint(2, 6)} facts about {rng.choice(TOPICS)}."}]
        for _ in range(n)
    ]  # fmt: skip


async def one_request(
    client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], max_tokens: int
) -> Sample:
    body = {
        "model": "default", "messages": messages, "max_tokens": max_tokens, "stream": True,
        "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    stamps: list[float] = []
    usage_tokens = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                stamps.append(time.perf_counter())
    if not stamps:
        return Sample(float("nan"), [], usage_tokens or 0)
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    return Sample(stamps[0] - start, itl, usage_tokens or len(stamps))


def worker_counters(url: str) -> dict[str, tuple[float, float]]:
    """deepinfer's per-worker (busy seconds, steps) counters from /metrics; {} for peers."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    found: dict[str, list[float]] = {}
    pattern = r'^deepinfer_worker_(busy_seconds|steps)_total\{worker="(\w+)"\} (\S+)$'
    for kind, worker, value in re.findall(pattern, text, re.M):
        found.setdefault(worker, [0.0, 0.0])[kind == "steps"] = float(value)
    return {w: (busy, steps) for w, (busy, steps) in found.items()}


def step_times(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Mean ms a step of each worker that ran steps between the two readings."""
    out = {}
    for worker, (busy, steps) in after.items():
        busy0, steps0 = before.get(worker, (0.0, 0.0))
        if steps > steps0:
            out[worker] = 1e3 * (busy - busy0) / (steps - steps0)
    return out


async def run_level(url: str, engine: str, c: int, per_client: int, max_tokens: int) -> Level:
    level = Level(engine, c)
    prompts = workload(c * per_client, seed=c)
    limits = httpx.Limits(max_connections=c + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await one_request(client, url, workload(1, seed=999)[0], 4)  # warm-up

        async def client_loop(i: int) -> None:
            for j in range(per_client):
                try:
                    sample = await one_request(client, url, prompts[i * per_client + j], max_tokens)
                except httpx.HTTPError as exc:  # counted and reported, never hidden
                    level.errors.append(repr(exc))
                    continue
                level.samples.append(sample)

        counters = await asyncio.to_thread(worker_counters, url)
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(i) for i in range(c)))
        level.wall_s = time.perf_counter() - start
        level.step_ms = step_times(counters, await asyncio.to_thread(worker_counters, url))
    return level


def table(rows: list[dict[str, float | int | str]]) -> str:
    head = "| engine | conc | reqs | errors | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | step ms |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['engine']} | {r['concurrency']} | {r['requests']} | {r['errors']} | {r['tok_per_s']:.1f} | "
            f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} | "
            f"{r['itl_p99_ms']:.1f} | {r.get('step_ms', '-')} |"
        )
    return "\n".join(lines)


def verdicts(rows: list[dict[str, float | int | str]]) -> str:
    """deepinfer's tokens/s against llama-server's: at least 1.2x at one stream, 3x at 32."""
    by = {(r["engine"], r["concurrency"]): float(r["tok_per_s"]) for r in rows}
    lines = []
    for c, target in ((1, 1.2), (32, 3.0)):
        ours, peer = by.get(("deepinfer", c)), by.get(("llama-server", c))
        if ours and peer:
            ratio = ours / peer
            verdict = "PASS" if ratio >= target else "FAIL"
            lines.append(
                f"- {verdict}: {c} stream(s) {ratio:.2f}x llama-server (target >= {target}x)"
            )
    return "\n".join(lines)


def plot(rows: list[dict[str, float | int | str]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for engine in sorted({str(r["engine"]) for r in rows}):
        rs = [r for r in rows if r["engine"] == engine]
        xs = [r["concurrency"] for r in rs]
        axes[0].plot(xs, [r["tok_per_s"] for r in rs], marker="o", label=engine)
        axes[1].plot(xs, [r["ttft_p50_ms"] for r in rs], marker="o", label=engine)
        axes[2].plot(xs, [r["itl_p99_ms"] for r in rs], marker="o", label=engine)
    for ax, title in zip(
        axes, ["aggregate tokens/s", "TTFT p50 (ms)", "ITL p99 (ms)"], strict=True
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--levels", default="1,2,4,8,16,32,64")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--deepinfer-args", default="", help="extra flags for server.py")
    ns = ap.parse_args()
    levels = [int(x) for x in ns.levels.split(",")]
    from deepinfer.environment import default_model_path

    model = default_model_path()
    rows = []
    port = free_port()
    with running(
        deepinfer_cmd(port, ns.deepinfer_args.split()), port, OUT / "deepinfer.log"
    ) as url:
        for c in levels:
            rows.append(
                asyncio.run(
                    run_level(url, "deepinfer", c, ns.requests_per_client, ns.max_tokens)
                ).row()
            )
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    peers = [] if ns.skip_llama else [("llama-server", find_llama_server())]
    peers += [] if ns.skip_llama else [("ik_llama.cpp", find_ik_llama_server())]
    for name, binary in peers:
        if binary is None:
            print(f"{name} not found (see bench/common.py for where it is looked for): skipped")
            continue
        for c in levels:
            port = free_port()
            log = OUT / f"{name}.log"
            with running(llama_cmd(binary, model, port, c, 1024), port, log) as url:
                rows.append(
                    asyncio.run(
                        run_level(url, name, c, ns.requests_per_client, ns.max_tokens)
                    ).row()
                )
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    text = f"{table(rows)}\n\n{verdicts(rows)}\n"
    (OUT / "serve.md").write_text(text)
    (OUT / "serve.json").write_text(json.dumps(rows, indent=1))
    plot(rows, OUT / "serve.png")
    print(text)


if __name__ == "__main__":
    main()
