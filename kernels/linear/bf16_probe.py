"""Whether this machine multiplies bfloat16 matrices fast: measured once, in a child process.

A CPU's flags do not say it: a VM may list AMX and fault on its tiles, and without AMX or
AVX-512 BF16 torch emulates bf16 at a fraction of float32's rate. The child imports torch,
multiplies the same [512, 1536] x [1536, 4096] product in float32 and in bf16 (the shape of a
prefill chunk's projection), checks the bf16 result against float32's, and prints both rates; a
crash, a timeout, a wrong result or a bf16 rate under `MIN_SPEEDUP` times float32's says no.
`Bf16Probe` starts it in a thread, so a model loads meanwhile, and keeps its verdict in a file
(`verdicts`) under a key of this machine (the CPU's model name and flags, its core count, the
Python and torch versions): the next start on the same machine reads it instead of starting the
child (about 3 s of a 1.5B model's start-up on two cores). A probe that timed out is not kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MIN_SPEEDUP = 2.0
"""bf16 matmul rate over float32's from which the bf16 tiles pay (their unpacking included)."""
TIMEOUT_S = 60.0
NOT_FINISHED = "the probe did not finish"
VERDICT_FILE = "bf16_probe.json"
"""The verdicts' file name (the loader keeps it in `machine_cache_dir()`)."""

_CHILD = """
import json, time, torch
torch.manual_seed(0)
x, w = torch.randn(512, 1536), torch.randn(4096, 1536)
rates = {}
for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
    a, b = x.to(dt), w.to(dt)
    out = a @ b.t()
    start = time.perf_counter()
    for _ in range(5):
        out = a @ b.t()
    rates[name] = 5 * 2 * 512 * 4096 * 1536 / (time.perf_counter() - start) / 1e9
    if name == "float32":
        ref = out
err = ((out.float() - ref).norm() / ref.norm()).item()
print(json.dumps({"gflops": rates, "rel_err": err}))
"""


def machine_key() -> str:
    """What the verdict depends on: the CPU as /proc/cpuinfo names it (model and flags of the
    first processor), the cores, the Python and torch versions; a hex digest."""
    cpu = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        first = text.split("\n\n", 1)[0]
        cpu = "\n".join(
            line for line in first.splitlines() if line.startswith(("model name", "flags"))
        )
    except OSError:
        cpu = platform.processor()
    parts = [cpu, str(os.cpu_count()), sys.version, torch.__version__, str(MIN_SPEEDUP)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def read_verdict(path: Path, key: str) -> tuple[bool, str] | None:
    """The verdict kept for `key` in `path`; None when there is none (or the file is unreadable)."""
    try:
        found = json.loads(path.read_text())
        if found.get("key") != key:
            return None
        return bool(found["fast"]), f"{found['said']} (kept from an earlier start)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_verdict(path: Path, key: str, fast: bool, said: str) -> None:
    """Keep a verdict (written whole, then renamed into place); a failure to write is logged."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "fast": fast, "said": said}))
        os.replace(tmp, path)
    except OSError as exc:
        log.info("could not keep the bf16 probe's verdict in %s: %s", path, exc)


def run_probe(timeout_s: float = TIMEOUT_S) -> tuple[bool, str]:
    """(whether bf16 matmuls are fast and right here, what was measured or went wrong)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{NOT_FINISHED}: {exc}"
    if done.returncode != 0:
        return False, f"the probe exited with {done.returncode}: {done.stderr.strip()[-300:]}"
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
        rates, err = found["gflops"], float(found["rel_err"])
        speedup = float(rates["bfloat16"]) / float(rates["float32"])
    except (ValueError, KeyError, IndexError, ZeroDivisionError) as exc:
        return False, f"the probe printed {done.stdout[-300:]!r}: {exc}"
    said = (
        f"bf16 {rates['bfloat16']:.0f} GFLOP/s, float32 {rates['float32']:.0f} "
        f"({speedup:.1f}x), relative error {err:.1e}"
    )
    if err > 2e-2:
        return False, f"bf16 results are wrong: {said}"
    return speedup >= MIN_SPEEDUP, said


class Bf16Probe:
    """`run_probe` in a thread (the child runs while the caller loads weights), or the verdict
    kept in `verdicts` for this machine. `shared()`: the process's one probe (the machine does
    not change while it runs)."""

    _shared: Bf16Probe | None = None
    _lock = threading.Lock()

    @classmethod
    def shared(cls, verdicts: Path | None = None) -> Bf16Probe:
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls(verdicts)
            return cls._shared

    def __init__(self, verdicts: Path | None = None) -> None:
        self._verdicts = verdicts
        self._key = machine_key() if verdicts is not None else ""
        kept = read_verdict(verdicts, self._key) if verdicts is not None else None
        self._result: tuple[bool, str] = kept or (False, "the probe did not run")
        self._thread: threading.Thread | None = None
        if kept is None:
            self._thread = threading.Thread(target=self._run, name="bf16-probe", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        self._result = fast, said = run_probe()
        if self._verdicts is not None and not said.startswith(NOT_FINISHED):
            write_verdict(self._verdicts, self._key, fast, said)

    def result(self) -> tuple[bool, str]:
        if self._thread is not None:
            self._thread.join()
        return self._result
