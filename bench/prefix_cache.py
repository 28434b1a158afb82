"""Prefix-cache benchmark: an agent-like multi-turn workload through the OpenAI chat API.

    python bench/prefix_cache.py                          # 16 sessions x 8 turns
    python bench/prefix_cache.py --sessions 4 --turns 3   # a quick run

Every session shares a ~1.5k-token system prompt with tool definitions; each turn appends the
previous answer and a new user message (streaming, temperature 0, `--max-tokens` per answer).
`--arrival together` (the default): every session starts at once, so their first turns all bring
the same new system prompt; `staggered`: session 0 first, the others once its first answer is in
(see run_sessions).
Scenarios, each on its own server process:

- cached: deepinfer with both cache tiers (`cache_retention: agent`), fresh cache dir.
- no cache: `--no-prefix-caching --no-disk-cache` and `cache_retention: none`.
- resumed: the cached server restarted on the same cache dir; the next turn of every session.
- cold: the same next turns on a fresh server with an empty cache dir.
- llama-server: the cached workload against llama.cpp (`cache_prompt` is on by default), when
  `find_llama_server()` finds one.

Targets: cached share of input tokens >= 95%, TTFT p50 cached/no-cache <= 0.2, resumed/cold <=
0.3, and beside llama-server: TTFT p99 at most a fifth of its. Writes bench/out/prefix_cache.md (+ .json) and bench/out/prefix_cache.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from common import (
    ROOT,
    deepinfer_cmd,
    find_llama_server,
    free_port,
    llama_cmd,
    running,
)  # fmt: skip
from prefix_cache_report import Sample, Scenario, plot, table, verdicts

OUT = ROOT / "bench" / "out"
Message = dict[str, str]

TOOLS: list[tuple[str, str, dict[str, tuple[str, str]], list[str]]] = [
    ("read_file", "Read a UTF-8 text file from the workspace and return its contents with line numbers. Use it before editing a file; large files are truncated to the requested range.",
     {"path": ("string", "Path relative to the workspace root."), "start_line": ("integer", "First line to return, 1-based."), "end_line": ("integer", "Last line to return, inclusive; omit for the end of the file.")}, ["path"]),
    ("write_file", "Create or overwrite a file in the workspace with the given contents. Parent directories are created as needed. Prefer apply_patch for small edits to existing files.",
     {"path": ("string", "Path relative to the workspace root."), "contents": ("string", "The complete new contents of the file."), "mode": ("string", "One of 'overwrite' or 'create_only'; 'create_only' fails if the file exists.")}, ["path", "contents"]),
    ("apply_patch", "Apply a unified diff to one or more files in the workspace. The patch must apply cleanly; on failure nothing is changed and the rejected hunks are returned.",
     {"patch": ("string", "A unified diff with ---/+++ headers relative to the workspace root."), "dry_run": ("boolean", "Check that the patch applies without writing anything.")}, ["patch"]),
    ("list_directory", "List the entries of a directory in the workspace, with sizes and modification times. Hidden files are skipped unless requested.",
     {"path": ("string", "Directory relative to the workspace root; '.' for the root."), "recursive": ("boolean", "List subdirectories too, up to max_depth."), "max_depth": ("integer", "Deepest level to list when recursive."), "include_hidden": ("boolean", "Include entries whose names start with a dot.")}, ["path"]),
    ("search_code", "Search the workspace for a regular expression and return matching lines with file names and line numbers, ordered by file. Binary files and ignored paths are skipped.",
     {"pattern": ("string", "A regular expression (Rust regex syntax)."), "glob": ("string", "Only search files whose paths match this glob, e.g. 'src/**/*.py'."), "case_sensitive": ("boolean", "Match case exactly; default false."), "max_results": ("integer", "Stop after this many matching lines.")}, ["pattern"]),
    ("run_shell", "Run a shell command in the workspace sandbox and return its exit status, stdout and stderr. Commands time out; network access is disabled; the environment is reset between calls.",
     {"command": ("string", "The command line, run with bash -lc."), "timeout_s": ("integer", "Seconds before the command is killed; at most 600."), "cwd": ("string", "Working directory relative to the workspace root.")}, ["command"]),
    ("run_tests", "Run the project's test suite, or a subset of it, and return a summary with the failing tests and their tracebacks.",
     {"selector": ("string", "A pytest node id, file or -k expression; omit for the whole suite."), "fail_fast": ("boolean", "Stop at the first failure."), "timeout_s": ("integer", "Seconds before the run is stopped.")}, []),
    ("http_request", "Send an HTTP request to an allow-listed internal service and return the status code, headers and up to 64 KiB of the body.",
     {"method": ("string", "GET, POST, PUT, PATCH or DELETE."), "url": ("string", "Absolute URL of an allow-listed host."), "headers": ("object", "Extra request headers as a JSON object."), "body": ("string", "Request body, sent as is.")}, ["method", "url"]),
    ("git", "Run a read-only git subcommand (status, diff, log, show, blame) in the workspace repository and return its output.",
     {"subcommand": ("string", "One of status, diff, log, show, blame."), "args": ("array", "Further arguments, one string per element."), "max_lines": ("integer", "Truncate the output after this many lines.")}, ["subcommand"]),
]  # fmt: skip

TASKS = ["the flaky integration test in tests/api", "the slow JSON encoder in the export job",
         "a memory leak in the websocket handler", "the broken pagination of /v1/orders",
         "timezone handling in the billing report", "retries in the payment client",
         "the CSV importer that drops quoted newlines", "a race in the cache invalidation"]  # fmt: skip
FOLLOW_UPS = ["Look at the relevant files first and tell me what you find.",
              "Good. Propose a minimal fix and say which tool calls you would make.",
              "Run the tests for that module and summarize the failures.",
              "Now apply the patch and explain the change in two sentences.",
              "Check git diff and make sure nothing unrelated changed.",
              "Add a regression test covering the original bug.",
              "Summarize what we did for the changelog.",
              "Any follow-up risks we should track?"]  # fmt: skip


def tool_schema(name: str, desc: str, props: dict[str, tuple[str, str]], req: list[str]) -> str:
    properties = {k: {"type": t, "description": d} for k, (t, d) in props.items()}
    schema = {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": properties, "required": req}}}  # fmt: skip
    return json.dumps(schema)


def system_prompt() -> str:
    tools = "\n".join(tool_schema(*t) for t in TOOLS)
    return (
        "You are Forge, a careful software engineering agent working in a sandboxed copy of the "
        "user's repository. Think step by step, keep answers short, and act through tools.\n\n"
        "# Rules\n- Read files before editing them; never guess at contents.\n- Prefer small, "
        "reviewable patches; run the relevant tests after every change.\n- Never run destructive "
        "commands (rm -rf, force pushes) and never print secrets.\n- When a tool fails, report the "
        "error and try a different approach instead of repeating the same call.\n- To call a tool, "
        'answer with one JSON object {"tool": NAME, "arguments": {...}} and nothing else.\n\n'
        f"# Tools\nThe following tools are available, as JSON schemas:\n{tools}\n"
    )


def user_message(session: int, turn: int) -> str:
    if turn == 0:
        return f"Session {session}: please help me fix {TASKS[session % len(TASKS)]}."
    return f"(turn {turn}) {FOLLOW_UPS[(turn - 1 + session) % len(FOLLOW_UPS)]}"


@dataclass(frozen=True)
class Target:
    url: str
    extra_body: dict[str, Any]
    has_metrics: bool = True


async def one_turn(
    client: httpx.AsyncClient, target: Target, messages: list[Message], max_tokens: int
) -> tuple[float, str, dict[str, Any]]:
    """Stream one chat turn: (TTFT seconds, answer text, final usage)."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True},
            **target.extra_body}  # fmt: skip
    for attempt in range(3):
        start = time.perf_counter()
        try:
            return await _stream_turn(client, f"{target.url}/v1/chat/completions", body, start)
        except httpx.RemoteProtocolError:  # a kept-alive connection the server had just closed
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


async def _stream_turn(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], start: float
) -> tuple[float, str, dict[str, Any]]:
    ttft, pieces, usage = float("nan"), list[str](), dict[str, Any]()
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if "timings" in chunk:  # llama-server: prompt tokens reused from its slot cache
                usage = {**usage, "llama_cache_n": chunk["timings"].get("cache_n")}
            choices = chunk.get("choices") or []
            text = (choices[0].get("delta") or {}).get("content") if choices else None
            if text:
                if not pieces:
                    ttft = time.perf_counter() - start
                pieces.append(text)
    return ttft, "".join(pieces), usage


def to_sample(session: int, turn: int, ttft: float, usage: dict[str, Any]) -> Sample:
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    if cached is None:
        cached = usage.get("llama_cache_n") or 0
    return Sample(session, turn, ttft, int(usage.get("prompt_tokens", 0)), int(cached))


def disk_cached_tokens(url: str) -> int:
    """deepinfer's counter of prompt tokens served from the disk tier."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    match = re.search(r'^deepinfer_cached_prompt_tokens_total\{tier="disk"\} (\S+)$', text, re.M)
    return int(float(match.group(1))) if match else 0


async def run_sessions(
    target: Target, histories: list[list[Message]], turns: range, args: argparse.Namespace,
    name: str,
) -> Scenario:  # fmt: skip
    """Play `turns` of every session, turns in order; extends histories. New sessions (turns from
    0) arrive together (`args.arrival`), or session 0 first and the others together once its
    first turn is answered, as agents that arrive over time. Sessions that resume (turns from
    > 0) all arrive at once, as after a restart."""
    scenario = Scenario(name)
    disk_before = disk_cached_tokens(target.url) if target.has_metrics else 0
    first_answered = asyncio.Event()
    gate = asyncio.Semaphore(args.concurrency or len(histories))
    limits = httpx.Limits(max_connections=len(histories) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:

        async def session(i: int) -> None:
            if i > 0 and turns.start == 0 and args.arrival == "staggered":
                await first_answered.wait()
            for t in turns:
                histories[i].append({"role": "user", "content": user_message(i, t)})
                async with gate:
                    ttft, answer, usage = await one_turn(
                        client, target, histories[i], args.max_tokens
                    )
                histories[i].append({"role": "assistant", "content": answer})
                scenario.samples.append(to_sample(i, t, ttft, usage))
                first_answered.set()

        await asyncio.gather(*(session(i) for i in range(len(histories))))
    if target.has_metrics:
        scenario.disk_tokens = disk_cached_tokens(target.url) - disk_before
    return scenario


def fresh_histories(n: int) -> list[list[Message]]:
    return [[{"role": "system", "content": system_prompt()}] for _ in range(n)]


def copy_histories(histories: list[list[Message]]) -> list[list[Message]]:
    return [list(h) for h in histories]


def run_deepinfer(args: argparse.Namespace, work: Path) -> list[Scenario]:
    extra = args.deepinfer_args.split()
    turns, resume = range(args.turns), range(args.turns, args.turns + 1)
    log = OUT / "prefix_cache_deepinfer.log"
    cached_args = [*extra, "--cache-dir", str(work / "cache")]
    port = free_port()
    with running(deepinfer_cmd(port, cached_args), port, log) as url:
        histories = fresh_histories(args.sessions)
        agent = Target(url, {"cache_retention": "agent"})
        cached = asyncio.run(run_sessions(agent, histories, turns, args, "cached"))
        report(cached)
    port = free_port()
    with running(deepinfer_cmd(port, cached_args), port, log) as url:
        agent = Target(url, {"cache_retention": "agent"})
        resumed_h = copy_histories(histories)
        resumed = asyncio.run(run_sessions(agent, resumed_h, resume, args, "resumed after restart"))
        report(resumed)
    port = free_port()
    with running(
        deepinfer_cmd(port, [*extra, "--cache-dir", str(work / "empty")]), port, log
    ) as url:
        agent = Target(url, {"cache_retention": "agent"})
        cold_h = copy_histories(histories)
        cold = asyncio.run(run_sessions(agent, cold_h, resume, args, "cold (empty cache dir)"))
        report(cold)
    port = free_port()
    none_args = [*extra, "--no-prefix-caching", "--no-disk-cache"]
    with running(deepinfer_cmd(port, none_args), port, log) as url:
        none = Target(url, {"cache_retention": "none"})
        baseline_h = fresh_histories(args.sessions)
        baseline = asyncio.run(run_sessions(none, baseline_h, turns, args, "no cache"))
        report(baseline)
    return [cached, baseline, resumed, cold]


def run_llama(args: argparse.Namespace) -> Scenario | None:
    binary = None if args.skip_llama else find_llama_server()
    if binary is None:
        print("llama-server not found (set LLAMA_SERVER or build it under third_party/): skipped")
        return None
    from deepinfer.environment import default_model_path

    port = free_port()
    slots = args.concurrency or args.sessions
    cmd = llama_cmd(binary, default_model_path(), port, slots, args.llama_ctx_per_slot)
    try:
        with running(cmd, port, OUT / "prefix_cache_llama.log") as url:
            target = Target(url, {"cache_prompt": True}, has_metrics=False)
            llama = asyncio.run(
                run_sessions(target, fresh_histories(args.sessions), range(args.turns), args, "llama-server")
            )  # fmt: skip
    except (httpx.HTTPError, RuntimeError) as exc:  # the peer failing must not lose our figures
        print(f"llama-server run failed ({exc!r}); see {OUT / 'prefix_cache_llama.log'}")
        return None
    report(llama)
    return llama


def report(s: Scenario) -> None:
    print(table([s.row()]).splitlines()[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8, help="turns before the restart")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    ap.add_argument("--concurrency", type=int, default=0, help="requests in flight (0: sessions)")
    ap.add_argument("--arrival", choices=["together", "staggered"], default="together")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument(
        "--llama-only", action="store_true", help="only the llama-server scenario (its row)"
    )
    ap.add_argument("--llama-ctx-per-slot", type=int, default=4096)
    ap.add_argument("--deepinfer-args", default="", help="extra flags for server.py")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.llama_only:
        llama_row = run_llama(args)
        if llama_row is not None:
            (OUT / "prefix_cache_llama.json").write_text(json.dumps(llama_row.row(), indent=1))
        return
    with tempfile.TemporaryDirectory(prefix="deepinfer-prefix-bench-") as work:
        scenarios = run_deepinfer(args, Path(work))
    llama = run_llama(args)
    scenarios += [llama] if llama else []
    rows = [s.row() for s in scenarios]
    config = f"{args.sessions} sessions x {args.turns} turns (+1 resumed), {args.max_tokens} tokens per answer, arriving {args.arrival}"
    text = f"# Prefix cache: {config}\n\n{table(rows)}\n\n{verdicts({r['scenario']: r for r in rows})}\n"
    (OUT / "prefix_cache.md").write_text(text)
    (OUT / "prefix_cache.json").write_text(json.dumps(rows, indent=1))
    plot(scenarios, OUT / "prefix_cache.png")
    print(text)


if __name__ == "__main__":
    main()
