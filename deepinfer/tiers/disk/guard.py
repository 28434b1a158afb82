"""`StoreSlot` and `Backoff`: how the disk tier swaps its store and paces its retries.

The slot lets reader threads (`load`, `contains_prefix`, `stats`) use the current store while the
writer thread may replace it (reopening after a failure, resetting a damaged index): `take`
withdraws the store and waits until no reader uses it, so an LMDB environment is never closed
under a transaction; meanwhile readers see no store (a miss).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class StoreSlot(Generic[T]):
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._store: T | None = None
        self._num_users = 0

    @property
    def current(self) -> T | None:
        """The store, for the thread that alone replaces it (it needs no `use`)."""
        return self._store

    @contextlib.contextmanager
    def use(self) -> Iterator[T | None]:
        """The store (None when there is none), kept open until the block exits."""
        with self._cond:
            store = self._store
            if store is not None:
                self._num_users += 1
        try:
            yield store
        finally:
            if store is not None:
                with self._cond:
                    self._num_users -= 1
                    self._cond.notify_all()

    def put(self, store: T) -> None:
        with self._cond:
            assert self._store is None, "take the old store before putting a new one"
            self._store = store

    def take(self) -> T | None:
        """Withdraw the store, once no reader uses it (the caller closes it)."""
        with self._cond:
            store, self._store = self._store, None
            while self._num_users:
                self._cond.wait()
        return store


class Backoff:
    """Retry pacing: after a failure, wait `first_s`; each failure at or after the retry time
    doubles the wait, up to `max_s`; a success resets it. Thread-safe; `clock` is monotonic
    seconds (tests inject their own)."""

    def __init__(self, first_s: float, max_s: float, clock: Callable[[], float]) -> None:
        self.first_s, self.max_s, self.clock = first_s, max_s, clock
        self._lock = threading.Lock()
        self._num_failures = 0
        self._until: float | None = None

    def fail(self) -> float:
        """Record a failure; returns the seconds until the next attempt."""
        with self._lock:
            now = self.clock()
            if self._until is None or now >= self._until:  # not already waiting: back off more
                self._num_failures += 1
                delay_s = min(self.first_s * 2.0 ** min(self._num_failures - 1, 32), self.max_s)
                self._until = now + delay_s
            return self._until - now

    def succeed(self) -> bool:
        """Reset; True when there were failures to forget."""
        with self._lock:
            failed = self._num_failures > 0
            self._num_failures, self._until = 0, None
            return failed

    def allow_now(self) -> None:
        """End the current wait (an attempt succeeded), keeping the count of failures: the next
        failure still waits longer, until `succeed`."""
        with self._lock:
            self._until = None

    def waiting(self) -> bool:
        """True until the next attempt is due."""
        until = self._until
        return until is not None and self.clock() < until
