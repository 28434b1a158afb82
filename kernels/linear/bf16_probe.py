"""Whether this machine multiplies bfloat16 matrices fast: measured once, in a child process.

A CPU's flags do not say it: a VM may list AMX and fault on its tiles, and without AMX or
AVX-512 BF16 torch emulates bf16 at a fraction of float32's rate. The child imports torch,
multiplies the same [512, 1536] x [1536, 4096] product in float32 and in bf16 (the shape of a
prefill chunk's projection), checks the bf16 result against float32's, and prints both rates; a
crash, a timeout, a wrong result or a bf16 rate under `MIN_SPEEDUP` times float32's says no to
bf16 attention. Whether the int8-served matrices should take long products as bf16 tiles is
another question, asked per block format: the child also multiplies the same rows by a weight
of random blocks in each format through the int8 kernel and through the tiles (their unpacking
included), and the tiles serve a format only where they are `TILES_MIN` times the kernel's rate
(on a Sapphire Rapids Xeon, AMX made them 1.6-2.2x; on a Zen 5 EPYC, whose int8 kernel runs
near 1 TOP/s, they lost on Q4_K and won a little on Q6_K).
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
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MIN_SPEEDUP = 2.0
"""bf16 matmul rate over float32's from which attention in bf16 pays."""
TILES_MIN = 1.1
"""The tiles' rate over the int8 kernel's, on a format's weight, from which they serve it."""
TIMEOUT_S = 60.0
NOT_FINISHED = "the probe did not finish"
VERDICT_FILE = "bf16_probe.json"
"""The verdicts' file name (the loader keeps it in `machine_cache_dir()`)."""
VERSION = "2"
"""Part of the machine key: a verdict of an older probe (no per-format tiles) is not read."""

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
tiles = {}
try:
    import numpy as np
    from deepinfer.kernels.linear.bf16_tiles import bf16_tiled_linear
    from deepinfer.kernels.linear.int8_matmul import int8_linear, pack_int8
    from deepinfer.kernels.linear.quant_matmul import QuantFormat, QuantizedWeight
    scales = {"Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
    rng = np.random.default_rng(0)
    for name, offsets in scales.items():  # random quants, float16 scales of 0.01
        fmt = QuantFormat[name]
        blocks = rng.integers(0, 256, (4096, 1536 // fmt.block_weights, fmt.block_bytes),
                              dtype=np.uint8)
        for at in offsets:
            blocks[..., at : at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        packed = pack_int8(QuantizedWeight(fmt, torch.from_numpy(blocks.reshape(4096, -1)), 1536))
        for kind, multiply in (("int8", int8_linear), ("tiles", bf16_tiled_linear)):
            multiply(x, packed)
            start = time.perf_counter()
            for _ in range(3):
                multiply(x, packed)
            rate = 3 * 2 * 512 * 4096 * 1536 / (time.perf_counter() - start) / 1e9
            tiles.setdefault(name, {})[kind] = rate
except Exception as exc:  # no native kernels here: no int8-served matrices either
    tiles = {"error": repr(exc)}
print(json.dumps({"gflops": rates, "rel_err": err, "tiles": tiles}))
"""


@dataclass(frozen=True)
class Bf16Verdict:
    attention: bool
    """Long-context prefill chunks attend in bf16 (bf16 matmuls fast and right here)."""
    tiles: frozenset[str] = frozenset()
    """The block formats (`QuantFormat` names) whose int8-served matrices take long products
    as bf16 tiles."""
    said: str = ""
    """What was measured, or what went wrong."""


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
    parts = [cpu, str(os.cpu_count()), sys.version, torch.__version__, str(MIN_SPEEDUP), VERSION]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def read_verdict(path: Path, key: str) -> Bf16Verdict | None:
    """The verdict kept for `key` in `path`; None when there is none (or the file is unreadable)."""
    try:
        found = json.loads(path.read_text())
        if found.get("key") != key:
            return None
        said = f"{found['said']} (kept from an earlier start)"
        return Bf16Verdict(bool(found["attention"]), frozenset(map(str, found["tiles"])), said)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_verdict(path: Path, key: str, verdict: Bf16Verdict) -> None:
    """Keep a verdict (written whole, then renamed into place); a failure to write is logged."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        kept = {"key": key, "attention": verdict.attention, "tiles": sorted(verdict.tiles),
                "said": verdict.said}  # fmt: skip
        tmp.write_text(json.dumps(kept))
        os.replace(tmp, path)
    except OSError as exc:
        log.info("could not keep the bf16 probe's verdict in %s: %s", path, exc)


def run_probe(timeout_s: float = TIMEOUT_S) -> Bf16Verdict:
    """Whether bf16 attention pays here and which formats' matrices the tiles serve, with what
    was measured or went wrong."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Bf16Verdict(False, said=f"{NOT_FINISHED}: {exc}")
    if done.returncode != 0:
        tail = done.stderr.strip()[-300:]
        return Bf16Verdict(False, said=f"the probe exited with {done.returncode}: {tail}")
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
        rates, err = found["gflops"], float(found["rel_err"])
        speedup = float(rates["bfloat16"]) / float(rates["float32"])
        measured = found["tiles"]
        tiles = {
            name: float(r["tiles"]) / float(r["int8"])
            for name, r in measured.items()
            if name != "error"
        }
    except (ValueError, KeyError, IndexError, ZeroDivisionError, TypeError, AttributeError) as exc:
        return Bf16Verdict(False, said=f"the probe printed {done.stdout[-300:]!r}: {exc}")
    per_format = ", ".join(f"{name} {ratio:.2f}x" for name, ratio in tiles.items())
    said = (
        f"bf16 {rates['bfloat16']:.0f} GFLOP/s, float32 {rates['float32']:.0f} "
        f"({speedup:.1f}x), relative error {err:.1e}; tiles against the int8 kernel: "
        f"{per_format or measured.get('error', 'not measured')}"
    )
    if err > 2e-2:
        return Bf16Verdict(False, said=f"bf16 results are wrong: {said}")
    chosen = frozenset(name for name, ratio in tiles.items() if ratio >= TILES_MIN)
    return Bf16Verdict(speedup >= MIN_SPEEDUP, chosen, said)


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
        self._result = kept or Bf16Verdict(False, said="the probe did not run")
        self._thread: threading.Thread | None = None
        if kept is None:
            self._thread = threading.Thread(target=self._run, name="bf16-probe", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        self._result = verdict = run_probe()
        if self._verdicts is not None and not verdict.said.startswith(NOT_FINISHED):
            write_verdict(self._verdicts, self._key, verdict)

    def result(self) -> Bf16Verdict:
        if self._thread is not None:
            self._thread.join()
        return self._result
