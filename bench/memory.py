"""Memory benchmark: the resident memory of a server idle after start and under load, for
deepinfer (`python server.py` with default flags) and, in the same run, llama.cpp's llama-server
on the same GGUF files.

    python bench/memory.py                                   # the default model
    python bench/memory.py --gguf qwen2.5-coder-1.5b=PATH    # and another GGUF beside it
    python bench/memory.py --label before                    # tag the rows (and the out files)

For each GGUF and server: RSS once /health answers and `--settle-s` have passed (idle), the peak
RSS while `--streams` concurrent streaming chat requests run (prompts of about `--prompt-words`
words, `--max-tokens` tokens each, `ignore_eos`), and the RSS once they have all finished. RSS is
summed over the server's process tree; "anon" is its anonymous part (RssAnon: what the server
wrote, without the file pages of memory-mapped weights, which the kernel can drop). llama-server
runs with as many slots as streams and `--llama-ctx-per-slot` tokens each (`-nr` where the CPU
lists AMX). Writes bench/out/memory[-LABEL].md (+ .json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil
from common import (
    ROOT,
    deepinfer_cmd,
    find_llama_server,
    free_port,
    llama_cmd,
    provenance,
    running_process,
)  # fmt: skip

OUT = ROOT / "bench" / "out"
MIB = 1 << 20
TOPICS = ["the ocean", "volcanoes", "a lighthouse", "bread", "the moon", "trains", "chess",
          "rain", "honeybees", "a library", "glaciers", "jazz", "bicycles", "deserts"]  # fmt: skip


@dataclass(frozen=True)
class Memory:
    rss_bytes: int
    anon_bytes: int


@dataclass(frozen=True)
class Row:
    label: str
    model: str
    server: str
    idle: Memory
    loaded_peak: Memory
    after_load: Memory
    generated_tokens: int
    load_s: float


def tree_memory(pid: int) -> Memory:
    """RSS and anonymous RSS of a process and its descendants."""
    rss = anon = 0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            rss += proc.memory_info().rss
            anon += _rss_anon(proc.pid)
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            continue
    return Memory(rss, anon)


def _rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    """Samples a process tree's memory every `period_s` on a thread; keeps the peak RSS."""

    def __init__(self, pid: int, period_s: float = 0.2) -> None:
        self.pid, self.period_s = pid, period_s
        self.peak = Memory(0, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = tree_memory(self.pid)
            if now.rss_bytes > self.peak.rss_bytes:
                self.peak = now
            self._stop.wait(self.period_s)


def prompt(i: int, words: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    filler = " ".join(f"{topic} note {k}." for k in range(words // 3))
    return f"Request {i}. Here are my notes: {filler} Now write a long essay about {topic}."


async def one_stream(client: httpx.AsyncClient, url: str, text: str, max_tokens: int) -> int:
    body = {"model": "default", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "stream": True, "temperature": 0.0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                usage = json.loads(line[6:]).get("usage")
                tokens = int(usage["completion_tokens"]) if usage else tokens
    return tokens


async def load(url: str, args: argparse.Namespace) -> int:
    """`args.streams` concurrent streams; the tokens generated in all."""
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        counts = await asyncio.gather(
            *(
                one_stream(client, url, prompt(i, args.prompt_words), args.max_tokens)
                for i in range(args.streams)
            )
        )
    return sum(counts)


def measure(
    cmd: list[str], port: int, log: Path, args: argparse.Namespace
) -> tuple[Memory, Memory, Memory, int, float]:
    """(idle, peak under load, after load, tokens generated, load seconds) of one server."""
    with running_process(cmd, port, log) as (url, proc):
        time.sleep(args.settle_s)
        idle = tree_memory(proc.pid)
        with PeakSampler(proc.pid) as sampler:
            start = time.perf_counter()
            tokens = asyncio.run(load(url, args))
            load_s = time.perf_counter() - start
        time.sleep(args.settle_s)
        return idle, sampler.peak, tree_memory(proc.pid), tokens, load_s


def servers(gguf: Path, args: argparse.Namespace) -> list[tuple[str, list[str], int]]:
    """(server name, command, port) for each server measured on `gguf`."""
    port = free_port()
    extra = [] if args.gguf_default == gguf else ["--model", str(gguf)]
    found = [("deepinfer", deepinfer_cmd(port, extra + args.deepinfer_args.split()), port)]
    binary = None if args.skip_llama else find_llama_server()
    if binary is None:
        print("llama-server not found (see bench/common.py for where it is looked for): skipped")
        return found
    port = free_port()
    cmd = llama_cmd(binary, gguf, port, args.streams, args.llama_ctx_per_slot)
    return [*found, ("llama-server", cmd, port)]


def mib(n: int) -> str:
    return f"{n / MIB:.0f}"


def table(rows: list[Row]) -> str:
    lines = [
        "| label | model | server | idle RSS MiB (anon) | loaded peak RSS MiB (anon) | after load "
        "RSS MiB (anon) | tokens | load s |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [f"{mib(m.rss_bytes)} ({mib(m.anon_bytes)})" for m in (r.idle, r.loaded_peak,
                                                                      r.after_load)]  # fmt: skip
        lines.append(f"| {r.label} | {r.model} | {r.server} | {' | '.join(cells)} | "
                     f"{r.generated_tokens} | {r.load_s:.1f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gguf", action="append", default=[], metavar="NAME=PATH",
                    help="another GGUF to measure (the default model is always measured)")  # fmt: skip
    ap.add_argument("--label", default="")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--settle-s", type=float, default=5.0)
    ap.add_argument("--llama-ctx-per-slot", type=int, default=1024)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--deepinfer-args", default="", help="extra flags for server.py")
    args = ap.parse_args()
    from deepinfer.environment import default_model_path

    args.gguf_default = default_model_path()
    models = [("smollm2-135m", args.gguf_default)]
    models += [(spec.split("=", 1)[0], Path(spec.split("=", 1)[1])) for spec in args.gguf]
    rows: list[Row] = []
    for name, gguf in models:
        for server, cmd, port in servers(gguf, args):
            log = OUT / f"memory-{server}-{name}.log"
            idle, peak, after, tokens, load_s = measure(cmd, port, log, args)
            rows.append(Row(args.label, name, server, idle, peak, after, tokens, load_s))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    suffix = f"-{args.label}" if args.label else ""
    OUT.mkdir(parents=True, exist_ok=True)
    text = f"{provenance()}\n\n{table(rows)}\n"
    (OUT / f"memory{suffix}.md").write_text(text)
    (OUT / f"memory{suffix}.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(text)


if __name__ == "__main__":
    main()
