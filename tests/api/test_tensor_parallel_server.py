"""The real server with `--tensor-parallel 2` (gloo ranks): it answers as one rank does; with its
other rank killed it answers 503 naming the lost rank (requests and /health), and a restarted
server serves again."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.server_proc import ServerProcs, free_port

pytestmark = pytest.mark.slow

BODY = {"model": "m", "prompt": "one two three four five", "max_tokens": 6, "temperature": 0.0}


def args(model: Path, cache: Path, ranks: int) -> list[str]:
    extra = (
        ["--tensor-parallel", str(ranks), "--master-port", str(free_port())] if ranks > 1 else []
    )
    return ["--model", str(model), "--cache-dir", str(cache), "--no-disk-cache",
            "--kv-dtype", "float32", "--matmul-activations", "float32", *extra]  # fmt: skip


def rank_processes(pid: int) -> list[int]:
    """The server's spawned rank processes (not multiprocessing's resource tracker)."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [
        int(c)
        for c in children.split()
        if "spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")
    ]


def test_a_lost_rank_is_a_503_with_the_reason(tmp_path: Path, tiny_llama_dir: Path) -> None:
    procs = ServerProcs(tmp_path)
    try:
        one, _ = procs.start(args(tiny_llama_dir, tmp_path / "c1", 1))
        want = httpx.post(f"{one}/v1/completions", json=BODY, timeout=60).json()
        procs.kill9(0)
        base, index = procs.start(args(tiny_llama_dir, tmp_path / "c2", 2))
        got = httpx.post(f"{base}/v1/completions", json=BODY, timeout=60).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        ranks = rank_processes(procs.procs[index].pid)
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        lost = httpx.post(f"{base}/v1/completions", json=BODY, timeout=60)
        assert lost.status_code in (500, 503)  # the request that finds the rank gone
        after = httpx.post(f"{base}/v1/completions", json=BODY, timeout=60)
        assert after.status_code == 503
        assert "tensor-parallel rank" in after.json()["error"]["message"]
        health = httpx.get(f"{base}/health", timeout=10)
        assert health.status_code == 503 and "tensor-parallel rank" in health.json()["reason"]
        procs.kill9(index)
        again, _ = procs.start(args(tiny_llama_dir, tmp_path / "c3", 2))
        got = httpx.post(f"{again}/v1/completions", json=BODY, timeout=60).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
    finally:
        procs.reap()
