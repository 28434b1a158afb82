"""`DiskTier`: the persistent prefix-cache tier, keyed by block hash, dealing in `bytes` payloads.

Threads, not coroutines (the cache layer stays free of asyncio): `offer` and `touch` only enqueue
and return at once; one writer thread owned by the tier drains the queue in batches (append,
fsync, index commit) and runs the periodic sweep. `load` and `contains_prefix` run on the calling
thread; `load` reads files and may take milliseconds, so an event loop calls it through
`loop.run_in_executor`. `contains_prefix` is one LMDB read transaction (microseconds).

Failures never escape: an unwritable directory, a full disk or a broken index puts the tier in
degraded mode (one warning, a counter, `stats().degraded`); lookups then miss and offers are
dropped, and writing is retried after `retry_degraded_s`. A second process on the same directory
opens it read-only (it serves hits; the first process keeps writing).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import lmdb

from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.disk.config import DiskTierConfig, fingerprint_dir
from deepinfer.cache.disk.records import check_hash
from deepinfer.cache.disk.store import DiskStore, PendingWrite, SweepResult
from deepinfer.cache.disk.write_queue import Pending, PendingTouch, WriteQueue

logger = logging.getLogger(__name__)
_ERRORS = (OSError, lmdb.Error)


@dataclass(frozen=True)
class DiskTierStats:
    num_lookups: int
    """Blocks asked of `load`."""
    num_hits: int
    """Of those, payloads returned (verified)."""
    num_writes: int
    """Blocks written to disk and indexed."""
    num_writes_dropped: int
    """Offers refused: queue full (disk slower than generation), degraded, or read-only."""
    num_evictions: int
    """Entries dropped for the byte budget (LRU) or with a reclaimed segment."""
    num_expirations: int
    num_checksum_failures: int
    """Records that failed verification on read (dropped, reported as misses)."""
    num_io_errors: int
    num_blocks: int
    live_bytes: int
    """Bytes of indexed records (headers included)."""
    disk_bytes: int
    """Bytes of segment files."""
    pending_bytes: int
    """Bytes waiting in the write-behind queue."""
    degraded: bool
    readonly: bool


class DiskTier:
    def __init__(
        self,
        fingerprint: str,
        config: DiskTierConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`fingerprint`: the model's KV fingerprint (the hash seed). `clock`: wall-clock seconds
        (expiry survives restarts, so it is wall time; tests inject their own)."""
        self.config = config or DiskTierConfig()
        self.directory = fingerprint_dir(self.config.root(), fingerprint)
        self.fingerprint = fingerprint
        self.clock = clock
        self._store: DiskStore | None = None
        self._queue = WriteQueue(self.config.max_pending_bytes)
        self._write_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("lookups", "hits", "writes", "dropped", "evictions", "expirations", "checksum", "io"),
            0,
        )
        self._lock_fd: int | None = None
        self._thread: threading.Thread | None = None
        self._degraded_until: float | None = None
        self._warned = False

    # lifecycle

    def open(self) -> None:
        """Open (or create) the index and segments and start the writer. Never raises for I/O:
        on failure the tier stays degraded and every lookup misses."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / "fingerprint").write_text(self.fingerprint)
            readonly = not self._take_writer_lock()
            self._store = DiskStore(self.directory, self.config, readonly=readonly)
            if not readonly:
                self._store.recover()
        except _ERRORS as exc:
            self._fail("cannot open the disk cache", exc)
            self._store = None
            return
        if not self._store.readonly:
            self._thread = threading.Thread(target=self._run, name="disk-tier-writer", daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (up to `timeout_s`), stop the writer and release the files."""
        self._queue.close()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
            with self._count_lock:
                c = dict(self._counts)
            logger.info(
                "disk cache closed: %d blocks written, %d offers dropped, %d bytes still queued",
                c["writes"], c["dropped"], self._queue.pending_bytes,
            )  # fmt: skip
        with self._write_lock:
            if self._store is not None:
                self._store.close()
                self._store = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

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

    # lookups (any thread)

    def contains_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks are on disk (index only; a later `load` may still miss)."""
        store = self._store
        if store is None:
            return 0
        try:
            return store.contains_prefix(block_hashes)
        except _ERRORS as exc:
            self._fail("disk cache index read failed", exc)
            return 0

    def load(self, block_hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """Verified payloads, None where absent or corrupt (a corrupt entry is dropped). Blocking
        file reads: call it from a worker thread, not from an event loop."""
        store = self._store
        if store is None:
            self._count(lookups=len(block_hashes))
            return [None] * len(block_hashes)
        try:
            result = store.load(block_hashes)
        except _ERRORS as exc:
            self._fail("disk cache read failed", exc)
            return [None] * len(block_hashes)
        hits = sum(p is not None for p in result.payloads)
        self._count(lookups=len(block_hashes), hits=hits, checksum=result.num_checksum_failures)
        return result.payloads

    # writes (non-blocking: enqueue only)

    def offer(
        self, block_hash: BlockHash, payload: bytes, num_tokens: int, retention: str | None = None
    ) -> bool:
        """Queue a full block for writing. False when not queued: `none` retention (not
        counted), or dropped (queue full, degraded, read-only; counted). Unknown retention
        classes raise `InvalidRequestError`."""
        check_hash(block_hash)
        retention = retention or self.config.default_retention
        ttl_s = self.config.ttl_s(retention)
        if ttl_s is None:
            return False
        item = PendingWrite(block_hash, bytes(payload), num_tokens, retention, ttl_s)
        if self._writable() and self._queue.offer(item):
            return True
        self._count(dropped=1)
        return False

    def touch(self, block_hashes: Sequence[BlockHash], retention: str | None = None) -> None:
        """Hits served (from any tier): refresh last access, and extend expiry to at least now
        plus the class's lifetime. Queued; dropped silently when the queue is full."""
        retention = retention or self.config.default_retention
        ttl_s = self.config.ttl_s(retention)
        if ttl_s is None or not block_hashes or not self._writable():
            return
        self._queue.offer(PendingTouch(tuple(block_hashes), retention, ttl_s, self.clock()))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything queued so far is on disk (or dropped). False on timeout."""
        return self._queue.wait_idle(timeout_s)

    def sweep(self) -> SweepResult | None:
        """Run a sweep now (the writer also runs one every `sweep_interval_s`)."""
        with self._write_lock:
            return self._sweep_locked()

    def _writable(self) -> bool:
        store = self._store
        if store is None or store.readonly or self._queue.closed:
            return False
        return self._degraded_until is None or time.monotonic() >= self._degraded_until

    # the writer thread

    def _run(self) -> None:
        next_sweep = time.monotonic() + self.config.sweep_interval_s
        while True:
            wait_s = max(0.0, next_sweep - time.monotonic())
            batch = self._queue.take(self.config.max_batch_blocks, wait_s)
            if not batch and self._queue.closed:
                return
            with self._write_lock:
                if batch:
                    self._write_locked(batch)
                    self._queue.done(batch)
                if time.monotonic() >= next_sweep or self._over_budget():
                    self._sweep_locked()
                    next_sweep = time.monotonic() + self.config.sweep_interval_s

    def _write_locked(self, batch: list[Pending]) -> None:
        store = self._store
        writes = [p for p in batch if isinstance(p, PendingWrite)]
        if store is None or not self._writable():
            self._count(dropped=len(writes))
            return
        try:
            for p in batch:
                if isinstance(p, PendingTouch):
                    store.index.touch_many(p.block_hashes, p.now_s, p.ttl_s, p.retention)
            if writes:
                self._count(writes=store.write(writes, self.clock()))
        except _ERRORS as exc:
            self._count(dropped=len(writes))
            self._fail("disk cache write failed; writes are dropped for now", exc)
            return
        self._degraded_until = None

    def _over_budget(self) -> bool:
        store = self._store
        try:
            budget = self.config.max_bytes - self.config.segment_bytes
            return store is not None and store.closed_bytes() > budget
        except _ERRORS:
            return False

    def _sweep_locked(self) -> SweepResult | None:
        store = self._store
        if store is None or store.readonly:
            return None
        try:
            result = store.sweep(self.clock())
        except _ERRORS as exc:
            self._fail("disk cache sweep failed", exc)
            return None
        self._count(evictions=result.num_evicted, expirations=result.num_expired)
        return result

    # accounting

    def _count(self, **deltas: int) -> None:
        with self._count_lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _fail(self, what: str, exc: BaseException) -> None:
        self._count(io=1)
        self._degraded_until = time.monotonic() + self.config.retry_degraded_s
        log = logger.debug if self._warned else logger.warning
        self._warned = True
        log("%s (%s): %s; serving without it, retrying later", what, self.directory, exc)

    @property
    def degraded(self) -> bool:
        until = self._degraded_until
        return self._store is None or (until is not None and time.monotonic() < until)

    def stats(self) -> DiskTierStats:
        store = self._store
        num_blocks = live = disk = 0
        if store is not None:
            try:
                num_blocks = store.index.num_blocks()
                live, disk = store.byte_counts()
            except _ERRORS as exc:
                self._fail("disk cache index read failed", exc)
        with self._count_lock:
            c = dict(self._counts)
        return DiskTierStats(
            num_lookups=c["lookups"], num_hits=c["hits"], num_writes=c["writes"],
            num_writes_dropped=c["dropped"], num_evictions=c["evictions"],
            num_expirations=c["expirations"], num_checksum_failures=c["checksum"],
            num_io_errors=c["io"], num_blocks=num_blocks, live_bytes=live, disk_bytes=disk,
            pending_bytes=self._queue.pending_bytes, degraded=self.degraded,
            readonly=store is not None and store.readonly,
        )  # fmt: skip

    def verify_all(self) -> int:
        """Read and verify every indexed record, with writing paused (O(data): for tests and
        offline checks). Returns how many failed (they are not dropped)."""
        with self._write_lock:
            return 0 if self._store is None else self._store.verify_all()

    def check_integrity(self) -> None:
        """Index tables consistent with each other and with the segment accounting."""
        with self._write_lock:
            if self._store is not None:
                self._store.check_integrity()
