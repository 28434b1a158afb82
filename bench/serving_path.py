"""The serving path alone: tokens/s streamed to many SSE clients by a server on the null model.

`python server.py --model null` runs the whole server (HTTP, API, engine, scheduler, sampler,
detokenizer, SSE) over a forward pass that costs nothing, so what this measures is everything
between the sampler and the socket. The load generator runs in its own process and is lean:
raw asyncio streams, one HTTP/1.1 request per connection, SSE lines counted as they arrive (the
token counts from the final usage chunk). Reported per level: tokens/s streamed, the server
process's CPU time per token (from /proc), and the client process's own CPU time (it must not
be the limit: well under its wall time).

With `--before REF`, the same server at git revision REF (checked out in a temporary worktree)
runs beside this tree's, and each level is measured on both in turn, `--repeats` times (medians
reported), so a before/after comparison shares one run and the machine's drift.

Run from the repository root:

    python bench/serving_path.py
    python bench/serving_path.py --before 03e2efa --repeats 3
    python bench/serving_path.py --clients 32 128 256 --max-tokens 256 --requests 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from common import provenance

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the load generator (its own process) --
async def stream_one(port: int, body: bytes) -> int:
    """One streamed chat completion; returns its completion tokens (from the usage chunk)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    tokens = 0
    async for line in reader:
        if line.startswith(b"data: {") and b'"usage":{' in line:
            usage = json.loads(line[6:]).get("usage")
            if usage:
                tokens = int(usage["completion_tokens"])
    writer.close()
    return tokens


async def client_level(port: int, clients: int, requests: int, max_tokens: int) -> dict[str, float]:
    body = json.dumps(
        {
            "model": "null",
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()

    async def client() -> int:
        return sum([await stream_one(port, body) for _ in range(requests)])

    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    counts = await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - start
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    return {"tokens": float(sum(counts)), "wall_s": wall, "client_cpu_s": cpu}


def run_client(port: int, clients: int, requests: int, max_tokens: int) -> dict[str, float]:
    """The load generator in a process of its own; its figures come back as JSON."""
    out = subprocess.run(
        [sys.executable, __file__, "--client", str(port), str(clients), str(requests),
         str(max_tokens)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the server --
def start_server(root: Path, port: int, max_num_seqs: int) -> subprocess.Popen[bytes]:
    """`root/server.py` on the null model (its own `deepinfer`: the script's folder comes first
    on the import path)."""
    server = subprocess.Popen(
        [sys.executable, str(root / "server.py"), "--model", "null", "--port", str(port),
         "--no-disk-cache", "--kv-memory-gb", "1", "--max-num-seqs", str(max_num_seqs),
         "--max-waiting", "4096"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root,
    )  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError(f"the server at {root} did not start")


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[Path]:
    """A detached checkout of `ref`, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="serving-path-before-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), ref],
                   check=True, capture_output=True)  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                       check=False, capture_output=True)  # fmt: skip


def measure(
    server: subprocess.Popen[bytes], port: int, clients: int, ns: argparse.Namespace
) -> tuple[float, float, float]:
    """(tokens/s, server CPU us per token, client CPU over wall) of one run."""
    cpu0 = cpu_seconds(server.pid)
    got = run_client(port, clients, ns.requests, ns.max_tokens)
    server_cpu = cpu_seconds(server.pid) - cpu0
    tokens, wall = got["tokens"], got["wall_s"]
    return tokens / wall, 1e6 * server_cpu / tokens, got["client_cpu_s"] / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[32, 128, 256])
    ap.add_argument("--requests", type=int, default=2, help="streamed requests per client")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--before", help="a git revision to measure beside this tree")
    ap.add_argument("--repeats", type=int, default=1, help="runs per level and server (median)")
    ap.add_argument("--client", nargs=4, type=int, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.client:
        print(json.dumps(asyncio.run(client_level(*ns.client))))
        return
    with contextlib.ExitStack() as stack:
        roots = {"this tree": ROOT}
        if ns.before:
            roots = {f"before ({ns.before})": stack.enter_context(worktree(ns.before)), **roots}
        servers = {}
        for name, root in roots.items():
            port = free_port()
            server = start_server(root, port, max(ns.clients))
            stack.callback(server.wait, 60)
            stack.callback(server.terminate)
            servers[name] = (server, port)
            run_client(port, 4, 1, 16)  # warm up: the first requests build what is lazy
        print(f"\n### Serving path, null model: `bench/serving_path.py`\n\n{provenance()}\n")
        print("| server | clients | tok/s streamed | server CPU us/token | client CPU / wall |")
        print("|---|---|---|---|---|")
        rates: dict[tuple[str, int], float] = {}
        for clients in ns.clients:
            runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in servers}
            for _ in range(ns.repeats):
                for name, (server, port) in servers.items():
                    runs[name].append(measure(server, port, clients, ns))
            for name, got in runs.items():
                rate, cpu, client = (statistics.median(v) for v in zip(*got, strict=True))
                rates[name, clients] = rate
                print(f"| {name} | {clients} | {rate:.0f} | {cpu:.1f} | {client:.2f} |", flush=True)
        if ns.before:
            before = next(iter(servers))
            ratios = ", ".join(
                f"{c} clients {rates['this tree', c] / rates[before, c]:.2f}x" for c in ns.clients
            )
            print(f"\nthis tree / before: {ratios}")


if __name__ == "__main__":
    main()
