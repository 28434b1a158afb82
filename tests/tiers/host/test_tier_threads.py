"""HostTier under concurrent use: threads offering, loading, leasing, probing and touching a tier
small enough to evict constantly, with integrity checked from another thread all along. Every
payload read must be exactly the one offered under its hash (no torn or recycled slot is seen)."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from deepinfer.tiers.host import HostTier

SIZE = 16 << 10
NUM_KEYS = 40


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def payload(i: int) -> bytes:
    return bytes([i]) * (SIZE // 2) + bytes([255 - i]) * (SIZE // 2)


@pytest.fixture
def fast_switching() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # interleave threads as often as possible
    yield
    sys.setswitchinterval(old)


def _worker(t: HostTier, seed: int, errors: list[str]) -> None:
    rng = random.Random(seed)
    for _ in range(1500):
        k, op = rng.randrange(NUM_KEYS), rng.random()
        if op < 0.4:
            t.offer(h(k), payload(k))
        elif op < 0.6:
            got = t.load([h(k)])[0]
            if got is not None and got != payload(k):
                errors.append(f"load of {k} returned another block's bytes")
        elif op < 0.8:
            keys = [k, (k + 1) % NUM_KEYS]
            views = t.lease([h(x) for x in keys])
            try:
                time.sleep(0)  # a real consumer (a device copy) lets other threads run
                for x, view in zip(keys, views, strict=False):
                    if bytes(view) != payload(x):
                        errors.append(f"lease of {x} shows another block's bytes")
            finally:
                t.release([h(x) for x in keys[: len(views)]])
        elif op < 0.9:
            t.contains_prefix([h(k), h((k + 1) % NUM_KEYS)])
        else:
            t.touch([h(k)])


@pytest.mark.usefixtures("fast_switching")
def test_concurrent_use_keeps_integrity_and_content() -> None:
    t = HostTier(SIZE, 8 * SIZE)
    errors: list[str] = []
    done = threading.Event()

    def checker() -> None:
        while not done.is_set():
            try:
                t.check_integrity()
            except Exception as exc:
                errors.append(repr(exc))
                return

    threads = [threading.Thread(target=_worker, args=(t, i, errors)) for i in range(4)]
    watcher = threading.Thread(target=checker)
    watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    watcher.join()
    assert errors == []
    t.check_integrity()
    s = t.stats()
    assert s.num_blocks == len(t.lru_hashes()) <= t.num_slots
    assert s.num_evictions > 0 and 0 < s.num_hits <= s.num_lookups
    assert t.load(t.lru_hashes()) == [payload(int.from_bytes(x, "little")) for x in t.lru_hashes()]
