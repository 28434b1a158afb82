"""Prefill/decode interference: how much do long prompts arriving mid-run hurt the inter-token
latency of ongoing streams, and how fast do short prompts get their first token meanwhile?

    python bench/interference.py                       # disagg, colocated, llama-server
    python bench/interference.py --quick --modes colocated,llama

(from the repository root; prefix `PYTHONPATH=.` where the installed deepinfer is another tree)

Per server (one after another, never two at once): `--streams` streaming chat sessions (greedy,
`ignore_eos`, re-issued in a loop) run through a ramp-up, then a baseline window (`--baseline-s`),
then the interference window, in which the `--long-prompts` arrive one after another (each sent once
the previous one is answered, `--long-gap-s` apart); `--short-offsets` seconds after each long
prompt, a ~50-token short prompt arrives (as many short prompts arrive during the baseline window).
Every prompt starts with its own random text, so no two share a cached prefix; deepinfer runs with
`--no-disk-cache` and a fresh server per mode. Long prompts are capped to the model's context.

ITL = gap between consecutive content chunks of one request (the first chunk excluded), assigned
to the window in which the later chunk arrived. Writes bench/out/interference.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from common import ROOT, deepinfer_cmd, find_llama_server, free_port, llama_cmd, running
from interference_report import plot, summarize, table

OUT = ROOT / "bench" / "out"
Message = dict[str, str]
WORD_LIST = """river stone lamp market winter garden signal copper harbor engine silver meadow
window ladder orbit canyon violin thunder pencil marble forest bridge candle rocket desert anchor
velvet island mirror circuit falcon glacier lantern puzzle quarry saddle tunnel walnut zephyr basket
cotton dragon ember fabric goblet hammer ivory jungle kettle lemon magnet needle oyster parrot
quiver ribbon spider tomato umbrella valley wagon yarn zipper"""
WORDS = WORD_LIST.split()
MODES = ("disagg", "split", "colocated", "llama")
QUICK = {"long_prompts": "500,1000", "baseline_s": 10.0}
CHATML_OVERHEAD_TOKENS = 14  # system + user + assistant header/footer tokens
CONTEXT_SLACK_TOKENS = 16  # room for templates that differ slightly from ChatML


@dataclass
class Workload:
    """Every prompt of one run; the same for every mode."""

    streams: list[list[Message]]
    longs: list[list[Message]]
    long_tokens: list[int]
    base_shorts: list[list[Message]]
    long_shorts: list[list[list[Message]]]
    context_tokens: int
    notes: list[str] = field(default_factory=list)


@dataclass
class Timed:
    """One request's arrival times, in seconds since the baseline window began."""

    kind: str
    sent_s: float
    first_s: float = float("nan")
    done_s: float = float("nan")
    prompt_tokens: int = 0
    during_prefill: bool | None = None

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.sent_s


def random_text(rng: random.Random, tokenizer: Any, tag: str, num_tokens: int) -> str:
    """`num_tokens` tokens of seeded random words, led by a unique tag (no shared prefix)."""
    words = [rng.choice(WORDS) + ("." if rng.random() < 0.1 else "") for _ in range(num_tokens)]
    ids = tokenizer.encode(f"[{tag}] " + " ".join(words))
    return str(tokenizer.decode(ids[: max(num_tokens, 8)]))


def chat(rng: random.Random, tokenizer: Any, tag: str, num_tokens: int, ask: str) -> list[Message]:
    body = max(num_tokens - CHATML_OVERHEAD_TOKENS - len(tokenizer.encode(ask)), 8)
    return [
        {"role": "system", "content": random_text(rng, tokenizer, tag, body)},
        {"role": "user", "content": ask},
    ]


def build_workload(args: argparse.Namespace) -> Workload:
    from deepinfer.environment import default_model_path
    from deepinfer.model.loading.gguf_loader import gguf_arch, open_gguf
    from deepinfer.text.tokenizer import Tokenizer

    reader = open_gguf(default_model_path())
    context = gguf_arch(reader).max_position_embeddings
    tokenizer = Tokenizer.from_gguf(reader)
    rng = random.Random(args.seed)
    limit = context - args.long_max_tokens - CONTEXT_SLACK_TOKENS
    requested = [int(x) for x in args.long_prompts.split(",")]
    long_tokens = [min(n, limit) for n in requested]
    notes = [
        f"long prompt of {n} tokens exceeds the model's {context}-token context: capped to {c}"
        for n, c in zip(requested, long_tokens, strict=True)
        if c != n
    ]
    story = "Tell a very long story about the words above, chapter by chapter."
    summary = "Summarize the text above in one sentence."
    short = "Name three of the words above."
    num_shorts = len(args.short_offsets)
    return Workload(
        streams=[chat(rng, tokenizer, f"stream {i}", args.stream_tokens, story)
                 for i in range(args.streams)],
        longs=[chat(rng, tokenizer, f"long {i}", n, summary) for i, n in enumerate(long_tokens)],
        long_tokens=long_tokens,
        context_tokens=context,
        base_shorts=[chat(rng, tokenizer, f"short b{j}", args.short_tokens, short)
                     for j in range(num_shorts)],
        long_shorts=[[chat(rng, tokenizer, f"short {i}.{j}", args.short_tokens, short)
                      for j in range(num_shorts)] for i in range(len(long_tokens))],
        notes=notes,
    )  # fmt: skip


async def chat_stream(
    client: httpx.AsyncClient, url: str, messages: list[Message], max_tokens: int,
    stamps: list[float],
) -> dict[str, Any]:  # fmt: skip
    """Stream one chat completion, appending each content chunk's arrival time; return usage."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "seed": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                stamps.append(time.perf_counter())
    return usage


async def stream_loop(
    client: httpx.AsyncClient, url: str, messages: list[Message], max_tokens: int,
    requests: list[list[float]], errors: list[str],
) -> None:  # fmt: skip
    """Keep one session streaming until cancelled: each finished request is re-issued."""
    while True:
        stamps: list[float] = []
        requests.append(stamps)
        try:
            await chat_stream(client, url, messages, max_tokens, stamps)
        except httpx.HTTPError as exc:  # counted and reported, never hidden
            errors.append(repr(exc))
            await asyncio.sleep(0.5)


async def timed(
    client: httpx.AsyncClient, url: str, messages: list[Message], max_tokens: int, kind: str,
    t0: float, delay_s: float = 0.0,
) -> Timed:  # fmt: skip
    await asyncio.sleep(delay_s)
    stamps: list[float] = []
    sample = Timed(kind, time.perf_counter() - t0)
    usage = await chat_stream(client, url, messages, max_tokens, stamps)
    sample.done_s = time.perf_counter() - t0
    sample.first_s = stamps[0] - t0 if stamps else float("nan")
    sample.prompt_tokens = int(usage.get("prompt_tokens", 0))
    return sample


async def wait_ramp(logs: list[list[list[float]]], errors: list[str], timeout_s: float) -> None:
    """Return once every stream has streamed two chunks (all first prefills are behind us)."""
    deadline = time.perf_counter() + timeout_s
    while not all(sum(len(r) for r in log) >= 2 for log in logs):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"streams did not start within {timeout_s} s; errors: {errors[:3]}")
        await asyncio.sleep(0.1)


async def long_round(
    client: httpx.AsyncClient, url: str, work: Workload, i: int, args: argparse.Namespace,
    t0: float,
) -> list[Timed]:  # fmt: skip
    """One long prompt and its short prompts (sent `short_offsets` after it); long first."""
    long_task = asyncio.create_task(
        timed(client, url, work.longs[i], args.long_max_tokens, f"long {work.long_tokens[i]}", t0)
    )
    shorts = [timed(client, url, m, args.short_max_tokens, "short interference", t0, d)
              for m, d in zip(work.long_shorts[i], args.short_offsets, strict=True)]  # fmt: skip
    done = await asyncio.gather(long_task, *shorts)
    for s in done[1:]:
        s.during_prefill = s.sent_s < done[0].first_s
    return done


async def windows(
    client: httpx.AsyncClient, url: str, work: Workload, args: argparse.Namespace, t0: float
) -> tuple[list[Timed], float]:
    """The baseline window (short prompts only, not awaited), then the interference window (long
    prompts one after another, with their short prompts); (samples, interference start s)."""
    num_base = len(work.base_shorts)
    base = [asyncio.create_task(timed(client, url, m, args.short_max_tokens, "short baseline", t0,
                                      args.baseline_s * (j + 1) / (num_base + 1)))
            for j, m in enumerate(work.base_shorts)]  # fmt: skip
    await asyncio.sleep(args.baseline_s)
    t_interference = time.perf_counter() - t0
    samples: list[Timed] = []
    for i in range(len(work.longs)):
        samples += await long_round(client, url, work, i, args, t0)
        await asyncio.sleep(args.long_gap_s if i + 1 < len(work.longs) else 0.0)
    samples = [*await asyncio.gather(*base), *samples]
    return samples, t_interference


async def measure(url: str, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """Drive one server through ramp-up, baseline and interference windows; raw results, times
    in seconds since the baseline window began."""
    limits = httpx.Limits(max_connections=args.streams + len(args.short_offsets) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        await chat_stream(client, url, work.base_shorts[0], 4, [])  # warm-up
        logs: list[list[list[float]]] = [[] for _ in work.streams]
        errors: list[str] = []
        tasks = [asyncio.create_task(stream_loop(client, url, m, args.stream_max_tokens, log, errors))
                 for m, log in zip(work.streams, logs, strict=True)]  # fmt: skip
        try:
            await wait_ramp(logs, errors, args.ramp_timeout_s)
            t0 = time.perf_counter()
            samples, t_interference = await windows(client, url, work, args, t0)
            t_end = time.perf_counter() - t0
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    gaps = [(b - t0, 1e3 * (b - a)) for log in logs for r in log for a, b in itertools.pairwise(r)]
    return {"windows": {"baseline": [0.0, t_interference], "interference": [t_interference, t_end]},
            "samples": [asdict(s) | {"ttft_s": s.ttft_s} for s in samples],
            "gaps": [(round(t, 4), round(g, 3)) for t, g in sorted(gaps)],
            "stream_errors": errors}  # fmt: skip


def mode_cmd(mode: str, port: int, work: Workload, args: argparse.Namespace) -> list[str] | None:
    extra = [*args.deepinfer_args.split(), "--no-disk-cache"]
    if mode == "disagg":
        return deepinfer_cmd(port, extra)
    if mode == "split":  # disaggregated, each worker with its own device group, model and pool
        prefill, decode = args.split_devices.split(",")
        return deepinfer_cmd(
            port, ["--prefill-devices", prefill, "--decode-devices", decode, *extra]
        )
    if mode == "colocated":
        help_text = subprocess.run([*deepinfer_cmd(0), "--help"], capture_output=True, text=True)
        if "--colocated" in help_text.stdout:
            return deepinfer_cmd(port, ["--colocated", *extra])
        print("server.py has no --colocated flag yet: 'colocated' runs the default server")
        return deepinfer_cmd(port, extra)
    binary = find_llama_server()
    if binary is None:
        print("llama-server not found (set LLAMA_SERVER or build it under third_party/): skipped")
        return None
    from deepinfer.environment import default_model_path

    # every slot must hold the longest prompt: llama-server splits -c evenly among slots
    slots = 2 * len(args.short_offsets) + args.streams + 1
    longest = max(max(work.long_tokens) + args.long_max_tokens,
                  args.stream_tokens + args.stream_max_tokens) + CONTEXT_SLACK_TOKENS  # fmt: skip
    per_slot = min(-(-longest // 256) * 256, work.context_tokens)
    return [
        *llama_cmd(binary, default_model_path(), port, slots, per_slot),
        *args.llama_args.split(),
    ]


def run_mode(mode: str, work: Workload, args: argparse.Namespace) -> dict[str, Any] | None:
    port = free_port()
    cmd = mode_cmd(mode, port, work, args)
    if cmd is None:
        return None
    log = OUT / f"interference_{mode}.log"
    print(f"== {mode}: {' '.join(cmd)}", flush=True)
    try:
        with running(cmd, port, log) as url:
            raw = asyncio.run(measure(url, work, args))
    except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        print(f"{mode} failed: {exc}\n" + "\n".join(tail), file=sys.stderr)
        return None
    summary = summarize(mode, raw)
    print(table([summary]).splitlines()[-1], flush=True)
    return {"mode": mode, "cmd": cmd, "summary": summary, "raw": raw}


def add_workload_args(
    ap: argparse.ArgumentParser, streams: int, long_prompts: str, baseline_s: float
) -> None:
    """The workload's flags (`measure` reads them), shared with bench/disagg_nodes.py."""
    ap.add_argument("--streams", type=int, default=streams, help="concurrent streaming sessions")
    ap.add_argument("--stream-tokens", type=int, default=64, help="prompt tokens of each session")
    ap.add_argument("--stream-max-tokens", type=int, default=256, help="per request; re-issued")
    ap.add_argument("--long-prompts", default=long_prompts, help="prompt tokens, in order")
    ap.add_argument("--long-max-tokens", type=int, default=8)
    ap.add_argument("--long-gap-s", type=float, default=2.0, help="pause between long prompts")
    ap.add_argument("--short-tokens", type=int, default=50)
    ap.add_argument("--short-max-tokens", type=int, default=4)
    ap.add_argument("--short-offsets", default="0.5,2.0", help="s after each long prompt")
    ap.add_argument("--baseline-s", type=float, default=baseline_s)
    ap.add_argument("--ramp-timeout-s", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompt text")
    ap.add_argument("--deepinfer-args", default="", help="extra flags for every server.py")
    ap.add_argument("--quick", action="store_true", help="smoke run: " + json.dumps(QUICK))


def parse_workload_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse, with `--quick`'s values where a flag was left at its default."""
    args = ap.parse_args()
    for key, value in QUICK.items() if args.quick else ():
        if getattr(args, key) == ap.get_default(key):
            setattr(args, key, value)
    args.short_offsets = [float(x) for x in args.short_offsets.split(",")]
    args.modes = [m.strip() for m in args.modes.split(",")]
    return args


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--modes", default="disagg,colocated,llama", help="any of disagg,split,colocated,llama"
    )
    add_workload_args(ap, streams=16, long_prompts="2000,8000,16000", baseline_s=20.0)
    ap.add_argument(
        "--split-devices",
        default="cpu:0,cpu:1",
        help="prefill,decode device groups of the 'split' mode (e.g. cuda:0,cuda:1)",
    )
    ap.add_argument("--llama-args", default="", help="extra flags for llama-server")
    args = parse_workload_args(ap)
    if unknown := set(args.modes) - set(MODES):
        ap.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    return args


def main() -> None:
    args = parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    work = build_workload(args)
    for note in work.notes:
        print(f"note: {note}")
    results = [r for m in args.modes if (r := run_mode(m, work, args))]
    if not results:
        sys.exit("no mode produced results")
    rows = [r["summary"] for r in results]
    config = (f"{args.streams} streams, long prompts {work.long_tokens} tokens "
              f"({args.long_gap_s} s apart), short prompts {args.short_offsets} s after each, "
              f"baseline {args.baseline_s} s; ITL and TTFT in ms")  # fmt: skip
    notes = "".join(f"\n- {n}" for n in work.notes)
    text = f"# Prefill/decode interference: {config}\n{notes}\n\n{table(rows)}\n"
    (OUT / "interference.md").write_text(text)
    (OUT / "interference.json").write_text(json.dumps({"args": vars(args), "results": results}))
    plot(results, OUT / "interference.png")
    print(text)


if __name__ == "__main__":
    main()
