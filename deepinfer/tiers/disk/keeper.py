"""`StoreKeeper`: the disk tier's store through failures: opening, retrying, healing, resetting.

It holds the current `DiskStore` (in a `StoreSlot`, so reader threads never see one closed under
them) and the tier's health. A failure anywhere (`fail`, from any thread) degrades the tier for a
backoff wait; after a plain I/O error the same store is used again, after anything else it is
reopened, and after LMDB called the index damaged the index is moved aside and started empty.
`maintain` does all of this; it runs on the writer thread (or under the tier's writer lock),
never on a request's path.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable
from pathlib import Path

import lmdb

from deepinfer.cache.block_hash import BlockHash
from deepinfer.tiers.disk.config import DiskTierConfig
from deepinfer.tiers.disk.guard import Backoff, StoreSlot
from deepinfer.tiers.disk.opener import BROKEN_INDEX_ERRORS, open_store
from deepinfer.tiers.disk.stats import Counters
from deepinfer.tiers.disk.store import DiskStore
from deepinfer.tiers.disk.write_queue import PendingHeal, WriteQueue

logger = logging.getLogger("deepinfer.tiers.disk.tier")
_IO_ERRORS = (OSError, lmdb.MapFullError, lmdb.DiskError)
"""Failures that say nothing against the index: retry with the same store."""


class StoreKeeper:
    def __init__(
        self,
        directory: Path,
        fingerprint: str,
        config: DiskTierConfig,
        clock: Callable[[], float],
        monotonic: Callable[[], float],
        counters: Counters,
        queue: WriteQueue,
    ) -> None:
        self.directory, self.fingerprint, self.config = directory, fingerprint, config
        self.clock = clock
        self.counters = counters
        self.queue = queue
        """Woken on failures (the writer then polls for the retry); offered a `PendingHeal` on
        open (the writer checks the index, and `flush` waits for it)."""
        self.slot: StoreSlot[DiskStore] = StoreSlot()
        self.retry = Backoff(config.retry_degraded_s, config.retry_max_s, monotonic)
        self.reopen_needed = False
        self.check_needed = False
        """The whole index is checked once after each open."""
        self.just_reset = False
        """The index was started empty and has not passed a check since."""
        self.reset_reason: str | None = None
        """Set when LMDB called the index damaged: `maintain` replaces it by an empty one."""
        self._lock_fd: int | None = None
        self._warned = False
        self.on_removed: Callable[[list[BlockHash]], None] | None = None
        """Told of index entries removed (KV events); set on each store opened, after its
        recovery (what an earlier process left was never announced)."""

    @property
    def store(self) -> DiskStore | None:
        return self.slot.current

    @property
    def degraded(self) -> bool:
        return self.store is None or self.reopen_needed or self.retry.waiting()

    def open(self, reset_reason: str | None = None) -> None:
        """(Re)open the store, replacing the current one (and the index by an empty one, with
        `reset_reason`); a failure is recorded, not raised."""
        _close_quietly(self.slot.take())
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / "fingerprint").write_text(self.fingerprint)
            readonly = self._lock_fd is None and not self._take_writer_lock()
            store, was_reset = open_store(
                self.directory, self.config, readonly, self.clock(), self._on_corrupt, reset_reason
            )
        except Exception as exc:
            self.fail("cannot open the disk cache", exc)
            return
        store.index.on_removed = self.on_removed
        self.slot.put(store)
        self.retry.allow_now()
        self.reopen_needed, self.reset_reason = False, None
        self.check_needed, self.just_reset = not store.readonly, was_reset
        self.counters.add(repairs=int(was_reset))
        if self.check_needed:
            self.queue.offer(PendingHeal())

    def close(self) -> None:
        _close_quietly(self.slot.take())
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def maintain(self) -> None:
        """Reset a damaged index (at once, unless the last reset has not proven itself yet),
        reopen the store when a retry is due, and heal the index when dirty or just opened."""
        if self.reset_reason is not None and not self.just_reset:
            self.open(self.reset_reason)
        elif self.retry.waiting():
            return
        elif self.store is None or self.reopen_needed:
            self.open(self.reset_reason)
        store = self.store
        if store is None or store.readonly or not (self.check_needed or store.index.dirty):
            return
        full, self.check_needed = self.check_needed, False
        try:
            healed = store.heal(full)
        except BROKEN_INDEX_ERRORS as exc:
            if self.just_reset:  # an empty index failing too: pace the resets
                self.fail("disk cache index is damaged", exc)
            else:
                self.open(f"{type(exc).__name__}: {exc}")
            return
        except Exception as exc:
            self.fail("disk cache index repair failed", exc)
            return
        self.counters.add(repairs=int(healed))
        self.just_reset = False
        self.succeeded()

    def fail(self, what: str, exc: BaseException) -> None:
        """Degrade for the backoff wait (any thread); one warning until the tier recovers."""
        self.counters.add(io=1)
        if not isinstance(exc, _IO_ERRORS):
            self.reopen_needed = True
        if isinstance(exc, BROKEN_INDEX_ERRORS):
            self.reset_reason = f"{type(exc).__name__}: {exc}"
        delay_s = self.retry.fail()
        self.queue.wake()
        log = logger.debug if self._warned else logger.warning
        self._warned = True
        log(
            "%s (%s): %s: %s; serving without it, retrying in %.0f s",
            what, self.directory, type(exc).__name__, exc, delay_s,
        )  # fmt: skip

    def succeeded(self) -> None:
        if self.retry.succeed():
            self._warned = False
            logger.info("disk cache %s is usable again", self.directory)

    def _on_corrupt(self, num: int) -> None:
        self.counters.add(corrupt=num)

    def _take_writer_lock(self) -> bool:
        fd = os.open(self.directory / "writer.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            logger.info("disk cache %s is written by another process: read-only", self.directory)
            return False
        self._lock_fd = fd
        return True


def _close_quietly(store: DiskStore | None) -> None:
    if store is None:
        return
    try:
        store.close()
    except Exception as exc:
        logger.debug("closing the disk cache store failed: %s", exc)
