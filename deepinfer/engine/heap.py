"""Freed heap given back to the operating system: once after start, then whenever the engine has
been idle for a while after working.

glibc's malloc keeps what is freed inside its arenas (one per thread that allocates: the loader's
thread, each worker's, the tokenizer's), and raises its mmap threshold whenever a large block is
freed, so that later blocks of that size come from the arenas too. A server that loaded its model
on one thread and ran a burst of long prompts on another keeps every arena at its high-water
mark: measured on SmolLM2, 440 MiB of the 1.1 GiB an idle server held after start was freed
memory in arenas. `malloc_trim(0)` returns the free pages of every arena (`madvise`), which the
next burst faults back in (a few milliseconds per 100 MiB), so it runs only after `idle_s` with
no step, at most once per idle period, on a thread of its own (it walks the arenas under their
locks; a step that starts meanwhile waits for at most one arena's walk).

Elsewhere than glibc (musl, macOS) there is no `malloc_trim`: nothing is trimmed.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import time
from collections.abc import Callable

log = logging.getLogger("deepinfer.engine")

IDLE_S = 2.0
"""How long the engine must be idle after a step before its heap is trimmed."""


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Give the free pages of every malloc arena back to the OS; whether any was (False where
    the C library has no `malloc_trim`). Blocking: milliseconds per hundred MiB freed."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


class IdleHeapTrim:
    """Trims the heap once the engine has been idle `idle_s` since its last step.

    `stepped()` after each step; `run()` is the owned task, polling at a fraction of `idle_s`."""

    def __init__(self, is_idle: Callable[[], bool], idle_s: float = IDLE_S) -> None:
        self._is_idle = is_idle
        self._idle_s = idle_s
        self._last_step: float | None = None
        """When the last step ended; None once trimmed since."""
        self.trims = 0

    def stepped(self) -> None:
        self._last_step = time.monotonic()

    def due(self, now: float) -> bool:
        last = self._last_step
        return last is not None and now - last >= self._idle_s and self._is_idle()

    async def trim(self) -> None:
        self._last_step = None
        await asyncio.to_thread(release_free_heap)
        self.trims += 1

    async def run(self) -> None:
        await self.trim()  # what loading the model and warming up left
        while True:
            await asyncio.sleep(self._idle_s / 4)
            if self.due(time.monotonic()):
                await self.trim()
