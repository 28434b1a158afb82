"""What an open dashboard costs serving: the same streaming load with and without `/dashboard`
open in headless Chromium (its stats stream ticking every second), measured in turn.

One headless Chromium lives through the whole run, showing a blank page or the dashboard, so
both conditions share its processes. The load is `serving_path.py`'s lean client (its own process: raw asyncio streams, SSE counted
as it arrives) at `--clients` concurrent streams. Reported per condition, medians over
`--repeats` alternated runs: tokens/s streamed and the server process's CPU time per token (what
the page makes the server pay, free of the browser's own rendering, which shares this machine);
the spread of the runs without the page is the noise the difference is judged against.

    python bench/dashboard_overhead.py                    # the default model, 32 streams
    python bench/dashboard_overhead.py --model null --max-tokens 256 --requests 2
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
from common import ROOT, free_port, provenance
from serving_path import cpu_seconds, run_client

CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def start_server(port: int, model: str | None, max_num_seqs: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, str(ROOT / "server.py"), "--port", str(port), "--no-disk-cache",
           "--max-num-seqs", str(max_num_seqs), "--max-waiting", "4096"]  # fmt: skip
    if model:
        cmd += ["--model", model]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.time() + 300
    while time.time() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        time.sleep(0.5)
    server.kill()
    raise RuntimeError("the server did not start")


@contextlib.contextmanager
def browser_page(chromium: str) -> Iterator[Any]:
    """A headless Chromium page, alive for the whole run (so both conditions share its
    processes: only whether it shows the dashboard differs)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1440, "height": 900})
        finally:
            browser.close()


def show(page: Any, url: str | None) -> None:
    """The dashboard at `url`, live; or (None) a blank page, the stream closed."""
    if url is None:
        page.goto("about:blank")
    else:
        page.goto(url)
        page.wait_for_selector("#stream-status[data-state=live]", timeout=30_000)
    time.sleep(3)  # settle: the first snapshots drawn, or the closed stream gone


def measure(
    server: subprocess.Popen[bytes], port: int, ns: argparse.Namespace
) -> tuple[float, float]:
    cpu0 = cpu_seconds(server.pid)
    got = run_client(port, ns.clients, ns.requests, ns.max_tokens)
    cpu = cpu_seconds(server.pid) - cpu0
    return got["tokens"] / got["wall_s"], 1e6 * cpu / got["tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="server.py's --model (default: the default model)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=1, help="streamed requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ns = ap.parse_args()
    port = free_port()
    server = start_server(port, ns.model, ns.clients)
    runs: dict[str, list[tuple[float, float]]] = {"without": [], "with dashboard": []}
    try:
        run_client(port, 4, 1, 16)  # warm up
        with browser_page(ns.chromium) as page:
            for _ in range(ns.repeats):
                show(page, None)
                runs["without"].append(measure(server, port, ns))
                show(page, f"http://127.0.0.1:{port}/dashboard")
                runs["with dashboard"].append(measure(server, port, ns))
    finally:
        server.terminate()
        server.wait(60)
    model = ns.model or "the default model (SmolLM2-135M Q4_1)"
    print(f"\n### Dashboard open vs not: `bench/dashboard_overhead.py`\n\n{provenance()}\n")
    print(f"{model}, {ns.clients} streams x {ns.requests} requests x {ns.max_tokens} tokens, "
          f"{ns.repeats} alternated runs each\n")  # fmt: skip
    print("| condition | tok/s (median) | tok/s (min-max) | server CPU us/token (median) |")
    print("|---|---|---|---|")
    medians = {}
    for name, got in runs.items():
        rates, cpus = zip(*got, strict=True)
        medians[name] = statistics.median(rates)
        print(f"| {name} | {medians[name]:.0f} | {min(rates):.0f}-{max(rates):.0f} | "
              f"{statistics.median(cpus):.1f} |")  # fmt: skip
    ratio = medians["with dashboard"] / medians["without"]
    print(f"\nwith / without: {ratio:.3f}x tokens/s")


if __name__ == "__main__":
    main()
