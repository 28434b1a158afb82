"""Freed heap given back to the OS: `malloc_trim` returns the free pages a thread's arena keeps
(measured on the freed blocks' own pages), and the engine trims once after start and once per
idle period after working, never while a lane has work."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import threading
from pathlib import Path

import pytest

from deepinfer.config import CacheConfig, Config, DiskCacheConfig, ModelConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.heap import IdleHeapTrim, _malloc_trim, release_free_heap
from deepinfer.request import SamplingParams
from tests.resident_pages import AVAILABLE, committed_bytes

needs_glibc = pytest.mark.skipif(_malloc_trim() is None, reason="no malloc_trim (not glibc)")


@needs_glibc
@pytest.mark.skipif(not AVAILABLE, reason="reads the blocks' pages from /proc")
def test_trim_returns_the_pages_an_arena_keeps() -> None:
    """64 KiB blocks (under the mmap threshold) written on a thread of their own, all freed but
    the last (which pins the arena's top, so free() cannot shrink it): the freed 96 MiB stay
    resident until the trim."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 64 << 10, 1536
    measured: dict[str, int] = {}

    def fill_and_free() -> None:
        blocks = [libc.malloc(size) for _ in range(count)]
        for block in blocks:
            ctypes.memset(block, 1, size)
        freed_blocks = [(block, size) for block in blocks[:-1]]
        measured["filled"] = committed_bytes(freed_blocks)
        for block in blocks[:-1]:
            libc.free(block)
        measured["freed"] = committed_bytes(freed_blocks)
        assert release_free_heap()
        measured["trimmed"] = committed_bytes(freed_blocks)
        libc.free(blocks[-1])

    thread = threading.Thread(target=fill_and_free)
    thread.start()
    thread.join()
    freed = (count - 1) * size
    assert measured["filled"] >= freed
    assert measured["filled"] - measured["freed"] < freed // 4  # free() kept them
    assert measured["freed"] - measured["trimmed"] > freed // 2  # the trim gave them back


def test_due_after_idle_and_once_per_idle_period() -> None:
    busy = [False]
    trim = IdleHeapTrim(lambda: not busy[0], idle_s=2.0)
    assert not trim.due(100.0)  # nothing stepped since the last trim
    trim.stepped()
    now = trim._last_step
    assert now is not None
    assert not trim.due(now + 1.0)
    assert trim.due(now + 2.5)
    busy[0] = True
    assert not trim.due(now + 10.0)  # a lane has work
    busy[0] = False
    asyncio.run(trim.trim())
    assert trim.trims == 1 and not trim.due(now + 20.0)  # trimmed: wait for the next step


async def test_engine_trims_after_start_and_when_idle_after_steps() -> None:
    config = Config(
        model=ModelConfig(path=Path("null")),
        cache=CacheConfig(kv_memory_bytes=64 << 20),
        disk_cache=DiskCacheConfig(enabled=False),
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(config) as engine:
        driver = engine._driver
        assert driver is not None
        for _ in range(100):
            if driver.heap.trims:
                break
            await asyncio.sleep(0.02)
        assert driver.heap.trims == 1  # what loading left
        async for _ in engine.generate("a prompt to step on", params):
            pass
        assert driver.heap._last_step is not None
        driver.heap._idle_s = 0.05
        for _ in range(100):
            if driver.heap.trims == 2:
                break
            await asyncio.sleep(0.05)
        assert driver.heap.trims == 2 and driver.heap._last_step is None
