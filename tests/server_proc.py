"""The real `server.py` as a child process on 127.0.0.1, for crash and replica tests: start, wait for
/health, chat, `kill -9`. Every process started is remembered so a test can reap them all."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Reply:
    text: str
    cached_tokens: int
    disk_cached_tokens: int


class ServerProcs:
    """Starts servers and owns them: `reap()` (call it in a finally) kills whatever still runs."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, extra: list[str]) -> tuple[str, int]:
        """Start one server; returns (base URL, process index) once /health answers."""
        return self.wait(*self.launch(extra))

    def launch(self, extra: list[str]) -> tuple[str, int]:
        """Start one server without waiting for it (model loads can then overlap)."""
        port = free_port()
        return self.launch_cmd([sys.executable, str(ROOT / "server.py"), "--port", str(port),
                                *extra], port)  # fmt: skip

    def launch_cmd(self, cmd: list[str], port: int) -> tuple[str, int]:
        """Start any HTTP server that answers /health on 127.0.0.1:`port` (a router, say)."""
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        with self.log_path(len(self.procs)).open("wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        return f"http://127.0.0.1:{port}", len(self.procs) - 1

    def wait(self, base: str, index: int, timeout_s: float = 120.0) -> tuple[str, int]:
        proc = self.procs[index]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {self.log_tail(index)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    return base, index
            time.sleep(0.2)
        raise TimeoutError(f"{base} not healthy after {timeout_s} s: {self.log_tail(index)}")

    def kill9(self, index: int) -> None:
        proc = self.procs[index]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(30)

    def reap(self) -> None:
        for i in range(len(self.procs)):
            self.kill9(i)

    def log_path(self, index: int) -> Path:
        return self.log_dir / f"server{index}.log"

    def log_tail(self, index: int, num_chars: int = 2000) -> str:
        path = self.log_path(index)
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""


def chat(client: httpx.Client, base: str, prompt: str, max_tokens: int) -> Reply:
    """One greedy, non-streamed chat completion."""
    body: dict[str, Any] = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    r = client.post(f"{base}/v1/chat/completions", json=body)
    r.raise_for_status()
    data = r.json()
    details = data["usage"]["prompt_tokens_details"]
    tiers = details.get("cached_tokens_details") or {}
    return Reply(
        data["choices"][0]["message"]["content"], details["cached_tokens"], tiers.get("disk", 0)
    )
