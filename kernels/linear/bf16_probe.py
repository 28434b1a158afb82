"""Whether this machine multiplies bfloat16 matrices fast: measured once, in a child process.

A CPU's flags do not say it: a VM may list AMX and fault on its tiles, and without AMX or
AVX-512 BF16 torch emulates bf16 at a fraction of float32's rate. The child imports torch,
multiplies the same [512, 1536] x [1536, 4096] product in float32 and in bf16 (the shape of a
prefill chunk's projection), checks the bf16 result against float32's, and prints both rates; a
crash, a timeout, a wrong result or a bf16 rate under `MIN_SPEEDUP` times float32's says no.
`Bf16Probe` starts it in a thread, so a model loads meanwhile.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

MIN_SPEEDUP = 2.0
"""bf16 matmul rate over float32's from which the bf16 tiles pay (their unpacking included)."""
TIMEOUT_S = 60.0

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


def run_probe(timeout_s: float = TIMEOUT_S) -> tuple[bool, str]:
    """(whether bf16 matmuls are fast and right here, what was measured or went wrong)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"the probe did not finish: {exc}"
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
    """`run_probe` in a thread (the child runs while the caller loads weights). `shared()`:
    the process's one probe (the machine does not change while it runs)."""

    _shared: Bf16Probe | None = None
    _lock = threading.Lock()

    @classmethod
    def shared(cls) -> Bf16Probe:
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def __init__(self) -> None:
        self._result: tuple[bool, str] = (False, "the probe did not run")
        self._thread = threading.Thread(target=self._run, name="bf16-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._result = run_probe()

    def result(self) -> tuple[bool, str]:
        self._thread.join()
        return self._result
