"""`WriteQueue`: the bounded write-behind queue between the engine and the disk writer thread.

`offer` never blocks: when the bytes waiting would exceed the bound, the item is refused (the
caller counts a dropped write), so a disk slower than generation costs cache entries, never decode
time. The writer takes batches and reports back with `done`, which is what `wait_idle` waits on.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from deepinfer.cache.block_hash import BlockHash
from deepinfer.tiers.disk.store import PendingWrite


@dataclass(frozen=True)
class PendingTouch:
    """Hits to refresh: last access = `now_s`, expiry at least `now_s + ttl_s`."""

    block_hashes: tuple[BlockHash, ...]
    retention: str
    ttl_s: float
    now_s: float


@dataclass(frozen=True)
class PendingHeal:
    """Wakes the writer to repair the index (and lets `wait_idle` wait for the repair)."""


Pending = PendingWrite | PendingTouch | PendingHeal


def _size(item: Pending) -> int:
    if isinstance(item, PendingWrite):
        return len(item.payload)
    if isinstance(item, PendingTouch):
        return 32 * len(item.block_hashes)
    return 0


class WriteQueue:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: deque[Pending] = deque()
        self._cond = threading.Condition()
        self._pending_bytes = 0
        self._num_busy = 0
        self._closed = False
        self._woken = False

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    def offer(self, item: Pending) -> bool:
        """Enqueue without waiting; False (nothing queued) when full or closed."""
        size = _size(item)
        with self._cond:
            if self._closed or self._pending_bytes + size > self.max_bytes:
                return False
            self._items.append(item)
            self._pending_bytes += size
            self._cond.notify_all()
        return True

    def take(self, max_items: int, timeout_s: float) -> list[Pending]:
        """Up to `max_items` items, waiting at most `timeout_s` for the first. The caller must
        call `done` after handling a non-empty batch."""
        with self._cond:
            if not self._items and not self._closed and not self._woken:
                self._cond.wait(timeout_s)
            self._woken = False
            batch: list[Pending] = []
            while self._items and len(batch) < max_items:
                batch.append(self._items.popleft())
            self._num_busy += 1 if batch else 0
            return batch

    def done(self, batch: list[Pending]) -> None:
        with self._cond:
            self._pending_bytes -= sum(_size(item) for item in batch)
            self._num_busy -= 1
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is queued or being written (False on timeout)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._items or self._num_busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def wake(self) -> None:
        """Make the writer's current or next `take` return at once (an empty batch, unless
        items wait), so it looks at its state again."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def close(self) -> None:
        """Refuse new items and wake the writer (items already queued are still handed out)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
