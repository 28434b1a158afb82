"""Scale-out benchmark: two replicas, each pinned to one core, behind vLLM's router from PyPI
(`vllm-router`), against one replica on both cores, on the agent workload.

    python bench/scale_out.py                             # 8 sessions x 6 turns
    python bench/scale_out.py --sessions 4 --turns 2      # a quick run

The workload is agents at work: `--sessions` sessions of `--kinds` agent kinds (sessions of
one kind share its ~1.5k-token system prompt: persona and tool list), each playing `--turns`
streamed chat turns (temperature 0, `--max-tokens` per answer); every turn after the first
carries a tool's output (`--tool-lines` log lines, ~44 tokens each) beside bench/prefix_cache.py's
user message, and the next turn follows `--think-s` after the answer (the agent running its
tools); session i starts `i * --start-gap-s` after the first. Scenarios, each on fresh processes
and empty cache directories, default server flags:

- one replica: `server.py` on both cores (`taskset -c 0,1`), no router.
- cache_aware: two replicas (`taskset -c 0` and `-c 1`) behind `vllm-router --policy cache_aware`
  (its prefix tree of the requests it routed; no events needed).
- round_robin: the same replicas behind `--policy round_robin`.
- kv_aware (`--kv-aware`): `--policy kv_aware`, routing on the replicas' KV events
  (`--kv-events-endpoint`) and the ids of our render endpoint.

Targets: cache_aware keeps at least 95% of the one replica's cached share of input tokens, and
round_robin's TTFT p99 is at least twice cache_aware's. Writes bench/out/scale_out.md (+ .json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from common import deepinfer_cmd, free_port, running
from prefix_cache import (
    TOOLS,
    Message,
    Target,
    one_turn,
    report,
    system_prompt,
    to_sample,
    tool_schema,
    user_message,
)  # fmt: skip
from prefix_cache_report import Scenario, table

OUT = Path(__file__).resolve().parent / "out"
BLOCK = 16  # the server's default --block-size


def kind_prompt(kind: int) -> str:
    """Kind 0 is prefix_cache's coding agent; the others differ from their first token on (their
    own persona, their tools in another order), so they share no cached block with it."""
    if kind == 0:
        return system_prompt()
    order = TOOLS[kind:] + TOOLS[:kind]
    tools = "\n".join(tool_schema(*t) for t in order)
    return (
        f"Agent profile {kind}: Scout-{kind}, a meticulous operations agent that investigates "
        "production incidents in a sandboxed replica of the service. Keep answers short, cite "
        "the evidence, and act through tools.\n\n# Rules\n- Gather logs and metrics before "
        "proposing a cause.\n- Never change production configuration; propose patches only.\n"
        '- To call a tool, answer with one JSON object {"tool": NAME, "arguments": {...}}.\n\n'
        f"# Tools\nThe following tools are available, as JSON schemas:\n{tools}\n"
    )


def tool_output(session: int, turn: int, lines: int) -> str:
    """A tool's result of about 25 tokens a line (a log excerpt), its own for each turn."""
    rows = [
        f"2026-03-{1 + turn:02d}T10:{i % 60:02d}:{(7 * i + session) % 60:02d}Z INFO svc-{session} "
        f"worker-{(i * 7 + turn) % 13} handled req {session * 10_000 + turn * 100 + i} "
        f"in {(i * 37 + session * 11 + turn) % 900 + 3} ms"
        for i in range(lines)
    ]
    return "\n".join(rows)


def agent_message(lines: int) -> Callable[[int, int], str]:
    """prefix_cache's user turns; every turn after the first carries a tool's output."""

    def message(session: int, turn: int) -> str:
        text = user_message(session, turn)
        if turn == 0 or lines == 0:
            return text
        return f"Tool output:\n{tool_output(session, turn, lines)}\n\n{text}"

    return message


def histories(sessions: int, kinds: int) -> list[list[Message]]:
    return [[{"role": "system", "content": kind_prompt(i % kinds)}] for i in range(sessions)]


def pinned(cores: str, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", cores, *cmd]


@contextlib.contextmanager
def replicas(work: Path, name: str, events: bool) -> Iterator[tuple[list[str], list[int]]]:
    """Two replicas, one per core, each with its own cache directory (and event sockets)."""
    with contextlib.ExitStack() as stack:
        urls, pubs = [], []
        for core in range(2):
            port, pub = free_port(), free_port()
            extra = ["--cache-dir", str(work / f"{name}-r{core}")]
            if events:
                extra += ["--kv-events-endpoint", f"tcp://*:{pub}"]
            cmd = pinned(str(core), deepinfer_cmd(port, extra))
            log = OUT / f"scale_out_{name}_r{core}.log"
            urls.append(stack.enter_context(running(cmd, port, log)))
            pubs.append(pub)
        yield urls, pubs


def router_cmd(port: int, policy: str, workers: list[str], pubs: list[int] | None) -> list[str]:
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--worker-urls", *workers, "--policy", policy,
           "--prometheus-port", str(free_port())]  # fmt: skip
    if pubs is not None:
        model = httpx.get(f"{workers[0]}/v1/models", timeout=30).json()["data"][0]["id"]
        cmd += ["--kv-event-model", model, "--kv-event-block-size", str(BLOCK)]
        for url, pub in zip(workers, pubs, strict=True):
            cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{pub}"]
    return cmd


def routed(args: argparse.Namespace, work: Path, policy: str) -> Scenario:
    events = policy == "kv_aware"
    with replicas(work, policy, events) as (workers, pubs):
        port = free_port()
        cmd = router_cmd(port, policy, workers, pubs if events else None)
        with running(cmd, port, OUT / f"scale_out_{policy}_router.log") as url:
            return play(args, url, policy)


def single(args: argparse.Namespace, work: Path) -> Scenario:
    port = free_port()
    cmd = pinned("0,1", deepinfer_cmd(port, ["--cache-dir", str(work / "single")]))
    with running(cmd, port, OUT / "scale_out_single.log") as url:
        return play(args, url, "one replica, 2 cores")


def play(args: argparse.Namespace, url: str, name: str) -> Scenario:
    scenario = asyncio.run(agents(args, Target(url, {}, has_metrics=False), name))
    report(scenario)
    return scenario


async def agents(args: argparse.Namespace, target: Target, name: str) -> Scenario:
    """Every session plays its turns in order, the next `--think-s` after an answer (the agent
    running its tools); session i starts `i * --start-gap-s` after the first."""
    scenario = Scenario(name)
    message = agent_message(args.tool_lines)
    hist = histories(args.sessions, args.kinds)
    limits = httpx.Limits(max_connections=args.sessions + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:

        async def session(i: int) -> None:
            await asyncio.sleep(i * args.start_gap_s)
            for t in range(args.turns):
                hist[i].append({"role": "user", "content": message(i, t)})
                ttft, answer, usage = await one_turn(client, target, hist[i], args.max_tokens)
                hist[i].append({"role": "assistant", "content": answer})
                scenario.samples.append(to_sample(i, t, ttft, usage))
                await asyncio.sleep(args.think_s)

        await asyncio.gather(*(session(i) for i in range(args.sessions)))
    return scenario


def verdicts(rows: dict[str, dict[str, Any]]) -> str:
    one, aware, rr = rows["one replica, 2 cores"], rows["cache_aware"], rows["round_robin"]
    share = aware["cached_share"] / one["cached_share"]
    p99 = rr["ttft_p99_ms"] / aware["ttft_p99_ms"]
    return "\n".join([
        f"- cache_aware cached share / one replica's: {share:.3f} (target >= 0.95): "
        f"{'met' if share >= 0.95 else 'NOT met'}",
        f"- round_robin TTFT p99 / cache_aware's: {p99:.2f} (target >= 2): "
        f"{'met' if p99 >= 2 else 'NOT met'}",
    ])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--kinds", type=int, default=2, help="agent kinds (shared system prompts)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    ap.add_argument("--tool-lines", type=int, default=8, help="tool output lines per turn")
    ap.add_argument("--think-s", type=float, default=1.0, help="pause after each answer")
    ap.add_argument("--start-gap-s", type=float, default=0.5, help="between session starts")
    ap.add_argument("--kv-aware", action="store_true", help="also the kv_aware policy")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    policies = ["cache_aware", "round_robin"] + (["kv_aware"] if args.kv_aware else [])
    with tempfile.TemporaryDirectory(prefix="deepinfer-scale-out-") as tmp:
        work = Path(tmp)
        scenarios = [single(args, work)] + [routed(args, work, p) for p in policies]
    rows = [s.row() for s in scenarios]
    config = (
        f"{args.sessions} sessions x {args.turns} turns, {args.kinds} agent kinds, "
        f"{args.tool_lines} tool output lines per turn, {args.max_tokens} tokens per answer, "
        f"{args.think_s} s between turns, sessions starting {args.start_gap_s} s apart"
    )
    text = (
        f"# Scale out: {config}\n\n{table(rows)}\n\n{verdicts({r['scenario']: r for r in rows})}\n"
    )
    (OUT / "scale_out.md").write_text(text)
    (OUT / "scale_out.json").write_text(json.dumps(rows, indent=1))
    print(text)


if __name__ == "__main__":
    main()
