"""How OpenMP threads wait at a barrier, decided before torch loads libgomp.

The native CPU kernels run their parallel loops on the OpenMP runtime torch loads (libgomp).
libgomp reads its wait policy from the environment once, when it is loaded. Each thread that
opens parallel regions owns a team of OpenMP threads: the loading thread, the prefill worker and
the decode worker each have one, so the process holds more OpenMP threads than a two-core
machine has CPUs. libgomp then "throttles" its waits: a thread that reaches a barrier first spins
100 times and sleeps on a futex, and the next region must wake it through the kernel. A decode
step opens some 300 regions (10 a layer); each sleep and wake costs tens of microseconds, and
some cost milliseconds when the scheduler is slow to run the woken thread. Measured on SmolLM2
at one stream on two cores (bench/RESULTS.md): the same step took 11 ms alone in a process and
14 ms with one more idle team beside it, with 30-47 ms outliers.

`OMP_WAIT_POLICY=active` raises the throttled spin to 1000 (libgomp's own ceiling), and
`GOMP_SPINCOUNT=300000` keeps the unthrottled spin at libgomp's default (a few milliseconds)
instead of the active policy's unbounded one, so an idle team still goes to sleep.
`apply_defaults` sets both unless the user set them; `import deepinfer` calls it, so it takes
effect whenever deepinfer is imported before torch (the CLI and `server.py` always are). An
application that imported torch first keeps libgomp's defaults unless it sets these variables
itself; the engine logs that at start (`loaded_too_late`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

DEFAULTS: Mapping[str, str] = {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "300000"}


def libgomp_loaded(maps_path: str = "/proc/self/maps") -> bool:
    """Whether this process has loaded libgomp already (Linux: its memory map; elsewhere:
    whether torch is imported)."""
    try:
        with open(maps_path, encoding="utf-8", errors="replace") as maps:
            return any("libgomp" in line for line in maps)
    except OSError:
        return "torch" in sys.modules


def apply_defaults(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set the `DEFAULTS` the environment lacks. False when some were missing and libgomp is
    already loaded: this process keeps libgomp's own waits (child processes get ours)."""
    env = os.environ if environ is None else environ
    missing = [name for name in DEFAULTS if name not in env]
    for name in missing:
        env[name] = DEFAULTS[name]
    return not (missing and libgomp_loaded())


def loaded_too_late() -> bool:
    """Whether libgomp was loaded before `import deepinfer` could set the defaults the user
    had not set (see the module docstring)."""
    return not _IN_TIME


_IN_TIME = apply_defaults()
