"""A victim stream's inter-token latency beside each class of hostile request, against alone.

    python bench/hostile.py                  # every class, default server flags
    python bench/hostile.py --classes grammar,trickle --victim-tokens 200

(from the repository root). One server on the default model, with its default flags (only
`--no-disk-cache`, so runs do not feed each other). The victim is one streamed chat (greedy,
`ignore_eos`, `--victim-tokens` tokens), re-issued `--rounds` times per phase: first alone, then
beside each hostile class in turn, the attack running for the whole phase in a process of its
own:

- `grammar`: new grammars one after another, each unseen (a salt in the text): the regex that
  holds ~150 MB once built, a schema whose references chain 3,000 deep (crashes the library's
  compiler), a 12,000-string choice (about a second to build).
- `tokenize`: 3 MB prompts to `/tokenize`, back to back (tokenized off the event loop).
- `trickle`: 300 connections from 127.0.0.2 trickling a body a byte a second.
- `flood`: 1,100 idle connections from 127.0.0.3 (past `--max-connections`).

ITL = the gap between two content chunks of the victim (its first chunk excluded). Prints a
table (p50, p99, max per phase, and max against alone); target: max at most 3x alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import resource
import sys
import time
from collections.abc import Awaitable, Callable

import httpx
from common import ROOT, deepinfer_cmd, free_port, percentile, provenance, running

CLASSES = ("grammar", "tokenize", "trickle", "flood")
CHAT = "/v1/chat/completions"


async def victim(base: str, tokens: int) -> list[float]:
    """One streamed chat's gaps between content chunks, in ms."""
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    gaps: list[float] = []
    last: float | None = None
    async with (
        httpx.AsyncClient(base_url=base, timeout=120) as client,
        client.stream("POST", CHAT, json=body) as r,
    ):
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if not delta.get("content"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append((now - last) * 1e3)
            last = now
    return gaps


async def grammar_attack(base: str, stop: asyncio.Event) -> None:
    deep = {
        f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]} for i in range(3000)
    }
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        n = 0
        while not stop.is_set():
            n += 1
            salt = f"s{n}x{time.time_ns()}"
            kinds = [
                {"guided_regex": f"{salt}(x{{1000}}){{1001}}"},
                {
                    "guided_json": {
                        "$ref": "#/$defs/d0",
                        "$defs": {**deep, "d3000": {"const": salt}},
                    }
                },
                {"guided_choice": [f"{salt} choice {i}" for i in range(12000)]},
            ]
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            await client.post(CHAT, json=body | kinds[n % len(kinds)])


async def tokenize_attack(base: str, stop: asyncio.Event) -> None:
    text = "lighthouse keeper " * (3_000_000 // 18)
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        while not stop.is_set():
            await client.post("/tokenize", json={"prompt": text})


async def _connections(
    port: int, count: int, source: str, stop: asyncio.Event, send: bytes, trickle: bool
) -> None:
    writers: list[asyncio.StreamWriter] = []
    for _ in range(count):
        with contextlib.suppress(OSError):
            _, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
            w.write(send)
            writers.append(w)
    while not stop.is_set():
        await asyncio.sleep(1.0)
        for w in writers:
            if trickle and not w.is_closing():
                with contextlib.suppress(OSError):
                    w.write(b"x")
    for w in writers:
        w.close()


def trickle_attack(port: int) -> Callable[[str, asyncio.Event], Awaitable[None]]:
    head = (
        f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        "content-length: 100000\r\n\r\n"
    ).encode()
    return lambda _base, stop: _connections(port, 300, "127.0.0.2", stop, head, trickle=True)


def flood_attack(port: int) -> Callable[[str, asyncio.Event], Awaitable[None]]:
    return lambda _base, stop: _connections(port, 1100, "127.0.0.3", stop, b"", trickle=False)


def _attack_process(name: str, base: str, port: int) -> None:
    """One attack, in a process of its own (its client work must not slow the victim's reader),
    until it is terminated."""
    attacks = {
        "grammar": grammar_attack,
        "tokenize": tokenize_attack,
        "trickle": trickle_attack(port),
        "flood": flood_attack(port),
    }
    asyncio.run(attacks[name](base, asyncio.Event()))


def phase(base: str, port: int, attack: str | None, rounds: int, tokens: int) -> list[float]:
    process = None
    if attack is not None:
        process = multiprocessing.Process(target=_attack_process, args=(attack, base, port))
        process.start()
        time.sleep(3.0)  # the attack under way before the victim starts
    gaps: list[float] = []
    try:
        for _ in range(rounds):
            gaps += asyncio.run(victim(base, tokens))
    finally:
        if process is not None:
            process.terminate()
            process.join(30)
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", default=",".join(CLASSES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--victim-tokens", type=int, default=150)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 8192), hard), hard))
    port = free_port()
    chosen = [c for c in args.classes.split(",") if c]
    cmd = deepinfer_cmd(port, ["--no-disk-cache"])
    rows: list[tuple[str, list[float]]] = []
    with running(cmd, port, ROOT / "bench" / "out" / "hostile_server.log") as base:
        phase(base, port, None, 1, 32)  # warm-up
        rows.append(("alone", phase(base, port, None, args.rounds, args.victim_tokens)))
        for name in chosen:
            rows.append((name, phase(base, port, name, args.rounds, args.victim_tokens)))
        health = httpx.get(base + "/health", timeout=10).status_code
    alone_max = max(rows[0][1])
    print(f"# {provenance()}")
    print(f"# python bench/hostile.py {' '.join(sys.argv[1:])}".rstrip())
    print("| phase | ITL p50 ms | ITL p99 ms | ITL max ms | max vs alone |")
    print("|---|---:|---:|---:|---:|")
    for name, gaps in rows:
        p50, p99, top = percentile(gaps, 50), percentile(gaps, 99), max(gaps)
        print(f"| {name} | {p50:.1f} | {p99:.1f} | {top:.1f} | {top / alone_max:.2f}x |")
    print(f"server /health after the run: {health}")


if __name__ == "__main__":
    main()
