"""How OpenMP's barrier waits cost a one-stream decode step, engine only and embedded.

Each case runs in a fresh process (libgomp reads its wait policy once, when torch loads it):

- `defaults`: torch imported before deepinfer, so libgomp keeps its own waits;
- `deepinfer`: deepinfer imported first (deepinfer/openmp_env.py sets OMP_WAIT_POLICY=active
  GOMP_SPINCOUNT=300000).

and measures, on SmolLM2 with a 140-token prompt and greedy decoding:

- `step alone`: `EngineCore` steps on the main thread, the only OpenMP team in the process;
- `step + idle team`: the same after another thread ran one two-thread torch op (its OpenMP
  team then idles, as a second worker's does in the server): the process holds more OpenMP
  threads than the machine has CPUs, and libgomp throttles its spinning;
- `embedded`: `AsyncEngine.generate` with the default configuration (two workers), tokens/s of
  64-token answers and their mean gap.

    python bench/openmp_waits.py --reps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from common import USER_ENV, provenance

CHILD = r"""
import json, sys, threading, time
mode, case, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "defaults":
    import torch
import deepinfer
import torch
from deepinfer.config import CacheConfig, Config, DiskCacheConfig, WorkersConfig
from deepinfer.request import Request, SamplingParams
PROMPT = list(range(100, 240))

def engine_steps(extra_team):
    from deepinfer.engine.core import EngineCore
    core = EngineCore(Config(cache=CacheConfig(num_blocks=1200),
                             disk_cache=DiskCacheConfig(enabled=False),
                             workers=WorkersConfig(colocated=True)))
    torch.set_num_threads(2)
    if extra_team:
        idle = threading.Event()
        def side():
            torch.set_num_threads(2)
            x = torch.randn(1024, 1024)
            (x @ x).sum()
            idle.wait()
        threading.Thread(target=side, daemon=True).start()
        time.sleep(0.5)
    lane = core.lanes[0]
    times = []
    for rep in range(3):
        sp = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
        core.add_request(Request(request_id=f"r{rep}", prompt_token_ids=PROMPT[rep:], sampling=sp))
        so = lane.schedule(); core.update(lane, so, core.execute(so))  # the prompt
        while lane.has_work:
            t0 = time.perf_counter()
            so = lane.schedule(); core.update(lane, so, core.execute(so))
            times.append(time.perf_counter() - t0)
    return times

async def embedded():
    from deepinfer.engine.async_engine import AsyncEngine
    from deepinfer.text.messages import ChatMessage
    rates, gaps = [], []
    async with AsyncEngine(Config(disk_cache=DiskCacheConfig(enabled=False))) as eng:
        for rep in range(6):
            msg = ChatMessage("user", f"Write a short paragraph about trains ({rep}).")
            sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
            stamps, t0 = [], time.perf_counter()
            async for _ in eng.generate([msg], sp):
                stamps.append(time.perf_counter())
            rates.append(len(stamps) / (stamps[-1] - t0))
            gaps += [b - a for a, b in zip(stamps, stamps[1:])]
    return rates, gaps

if case == "embedded":
    import asyncio
    rates, gaps = asyncio.run(embedded())
    print(json.dumps({"tok_s": sorted(rates)[len(rates) // 2], "gap_ms": 1e3 * sum(gaps) / len(gaps)}))
else:
    t = sorted(engine_steps(case == "extra"))
    print(json.dumps({"p50_ms": 1e3 * t[len(t) // 2], "mean_ms": 1e3 * sum(t) / len(t),
                      "max_ms": 1e3 * t[-1]}))
"""


def run(mode: str, case: str, steps: int) -> dict[str, float]:
    env = {k: v for k, v in USER_ENV.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, case, str(steps)],
        env={**env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=3, help="processes per case, alternated")
    ap.add_argument("--steps", type=int, default=64, help="decode steps a request")
    ns = ap.parse_args()
    cases = [("alone", "step alone"), ("extra", "step + idle team"), ("embedded", "embedded")]
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(ns.reps):
        for case, _label in cases:
            for mode in ("defaults", "deepinfer"):
                results.setdefault((case, mode), []).append(run(mode, case, ns.steps))
    print(provenance())
    print()
    print("| case | waits | step p50 ms | step mean ms | step max ms | tok/s | mean gap ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for case, label in cases:
        for mode in ("defaults", "deepinfer"):
            rs = results[(case, mode)]

            def med(key: str, rs: list[dict[str, float]] = rs) -> str:
                vals = [r[key] for r in rs if key in r]
                return f"{statistics.median(vals):.1f}" if vals else ""

            row = [med("p50_ms"), med("mean_ms"), med("max_ms"), med("tok_s"), med("gap_ms")]
            print(f"| {label} | {mode} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
