"""Prefill and decode on different replicas (`--kv-transfer nixl`) behind vLLM's router in its PD
mode, against one colocated replica, in one run: long prompts arriving while streams decode.

    python bench/disagg_nodes.py                 # 8 streams, 4k and 8k-token prompts
    python bench/disagg_nodes.py --quick

(from the repository root; prefix `PYTHONPATH=.` where the installed deepinfer is another tree)

`replica`: one server with its default flags (its prefill and decode workers share the cores).
`nodes`: a producer and a consumer, each its own process with `--threads` of the cores (`1` and
`1` on two cores), and `vllm-router --vllm-pd-disaggregation` in front: every request is
prefilled by the producer, its KV pulled over NIXL (UCX: shared memory or TCP here) by the
consumer, which decodes. Both modes see the same workload through `bench/interference.py`'s
driver: `--streams` streaming sessions re-issued in a loop, a baseline window, then the long
prompts one after another with short prompts after each. Reported: the streams' ITL p50/p99 in
each window (on the consumer for `nodes`), the long and short prompts' TTFT, and the consumer's
transfer counters. Writes bench/out/disagg_nodes.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from common import ROOT, deepinfer_cmd, free_port, provenance, running
from interference import add_workload_args, build_workload, measure, parse_workload_args
from interference_report import summarize, table

OUT = ROOT / "bench" / "out"
TRANSFER = re.compile(r"^(deepinfer_kv_transfer_\w+?)(?:_total)? (\S+)$", re.M)


def transfer_counters(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {name: float(value) for name, value in TRANSFER.findall(text)}


@contextlib.contextmanager
def nodes(args: argparse.Namespace, log_dir: Path) -> Iterator[tuple[str, str]]:
    """A producer, a consumer and the router; yields (router URL, consumer URL)."""
    common = [*args.deepinfer_args.split(), "--no-disk-cache", "--kv-transfer", "nixl"]
    threads = args.node_threads.split(",")
    with contextlib.ExitStack() as stack:
        urls = []
        for role, n in zip(("producer", "consumer"), threads, strict=True):
            port = free_port()
            cmd = deepinfer_cmd(port, [*common, "--kv-role", role, "--threads", n, "--colocated"])
            print(f"== {role}: {' '.join(cmd)}", flush=True)
            urls.append(stack.enter_context(running(cmd, port, log_dir / f"nodes_{role}.log")))
        port = free_port()
        router = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
                  "--port", str(port), "--vllm-pd-disaggregation", "--prefill", urls[0],
                  "--decode", urls[1], "--policy", "round_robin",
                  "--prometheus-port", str(free_port())]  # fmt: skip
        print(f"== router: {' '.join(router)}", flush=True)
        yield stack.enter_context(running(router, port, log_dir / "nodes_router.log")), urls[1]


def run(mode: str, work: Any, args: argparse.Namespace) -> dict[str, Any]:
    if mode == "nodes":
        with nodes(args, OUT) as (url, consumer):
            raw = asyncio.run(measure(url, work, args))
            counters = transfer_counters(consumer)
    else:
        port = free_port()
        cmd = deepinfer_cmd(port, [*args.deepinfer_args.split(), "--no-disk-cache"])
        print(f"== replica: {' '.join(cmd)}", flush=True)
        with running(cmd, port, OUT / "nodes_replica.log") as url:
            raw = asyncio.run(measure(url, work, args))
        counters = {}
    summary = summarize(mode, raw)
    print(table([summary]).splitlines()[-1], flush=True)
    return {"mode": mode, "summary": summary, "transfer": counters, "raw": raw}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--modes", default="replica,nodes", help="any of replica,nodes")
    add_workload_args(ap, streams=8, long_prompts="4000,8000", baseline_s=15.0)
    ap.add_argument("--node-threads", default="1,1", help="producer,consumer CPU threads")
    return parse_workload_args(ap)


def main() -> None:
    args = parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    work = build_workload(args)
    results = [run(m, work, args) for m in args.modes]
    config = (f"{args.streams} streams, long prompts {work.long_tokens} tokens "
              f"({args.long_gap_s} s apart), short prompts {args.short_offsets} s after each, "
              f"baseline {args.baseline_s} s; ITL and TTFT in ms")  # fmt: skip
    counters = "".join(
        f"\n- {r['mode']} consumer: "
        + ", ".join(f"{k[22:]} {v:g}" for k, v in r["transfer"].items())
        for r in results
        if r["transfer"]
    )
    text = (f"# Prefill and decode on different replicas: {config}\n\n{provenance()}\n\n"
            f"{table([r['summary'] for r in results])}\n{counters}\n")  # fmt: skip
    (OUT / "disagg_nodes.md").write_text(text)
    (OUT / "disagg_nodes.json").write_text(json.dumps({"args": vars(args), "results": results}))
    print(text)


if __name__ == "__main__":
    main()
