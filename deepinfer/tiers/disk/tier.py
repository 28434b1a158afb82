"""`DiskTier`: the persistent prefix-cache tier, keyed by block hash, dealing in `bytes` payloads.

Threads, and one coroutine (the cache layer imports no asyncio): `offer` and `touch` only enqueue
and return at once; one writer thread owned by the tier drains the queue in batches (append,
fsync, index commit), runs the periodic sweep, and heals and reopens the store. `load` and
`contains_prefix` run on the calling thread; `load` reads files and may take milliseconds, so an
event loop awaits `load_async` instead (the same steps: LMDB and checksums on the loop's
executor, segment reads through aiofiles). `contains_prefix` is one LMDB read transaction
(microseconds).

Failures never escape: any exception inside the tier (an unwritable directory, a full disk, a
damaged index, a bug) puts it in degraded mode (one warning, a counter, `stats().degraded`):
offers are dropped, and a lookup the store cannot answer misses. It tries again after
`retry_degraded_s`, the wait doubling after each failed retry up to `retry_max_s`: after a plain
I/O error the writer just writes again; after anything else (a failed open, an index error) it
reopens the store (keeper.py). A full filesystem is not waited out: the writer lowers the byte
budget below what the tier holds, evicts down to it and writes the batch again, and the budget
follows the free space back up to `max_bytes` (budget.py). A file where one of the tier's folders should
be is left alone: the tier stays degraded, retrying, until it is gone. Only bad arguments raise (`InvalidRequestError`: unknown retention).

Damage is healed, never served: a record that fails to decode (`num_corrupt_records`) or to
verify (`num_checksum_failures`) is a miss and is dropped; tables found to disagree are rebuilt
from the block table by the writer (`num_index_repairs`), which also checks the whole index each
time it opens it; an index LMDB cannot open is moved aside and rebuilt empty (opener.py).
LMDB keeps no checksums of its own pages: damage inside its page structure (not in our records)
can still stop the process inside LMDB's C code; records, segments and payloads are ours to
verify, and are. A file LMDB maps, truncated or replaced under the running tier, is caught before
the next transaction reads it (index_files.py) and the index is set aside like any damaged one.
A second process on the same directory opens it read-only (it serves hits; the first process
keeps writing).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from deepinfer.cache.block_hash import BlockHash
from deepinfer.kv_events.recorder import BlockOrigin, MediumEvents
from deepinfer.tiers.disk.async_reads import load_records
from deepinfer.tiers.disk.budget import ByteBudget, free_bytes, is_no_space
from deepinfer.tiers.disk.config import DiskTierConfig, fingerprint_dir
from deepinfer.tiers.disk.keeper import StoreKeeper
from deepinfer.tiers.disk.records import check_hash
from deepinfer.tiers.disk.segments import record_bytes
from deepinfer.tiers.disk.stats import Counters, make_stats
from deepinfer.tiers.disk.store import DiskStore, LoadResult, PendingWrite, SweepResult
from deepinfer.tiers.disk.summary import summarize
from deepinfer.tiers.disk.write_queue import Pending, PendingHeal, PendingTouch, WriteQueue
from deepinfer.tiers.stats import ClassSummary, DiskSummary, DiskTierStats

logger = logging.getLogger(__name__)
_POLL_S = 0.2
"""While degraded, the writer wakes this often (real seconds) to see whether a retry is due."""

__all__ = ["DiskTier", "DiskTierStats"]


class DiskTier:
    def __init__(
        self,
        fingerprint: str,
        config: DiskTierConfig | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """`fingerprint`: the model's KV fingerprint (the hash seed). `clock`: wall-clock seconds
        (expiry survives restarts, so it is wall time); `monotonic`: seconds for retries and the
        sweep period (tests inject their own)."""
        self.config = config or DiskTierConfig()
        self.directory = fingerprint_dir(self.config.root(), fingerprint)
        self.fingerprint = fingerprint
        self.clock, self.monotonic = clock, monotonic
        self._queue = WriteQueue(self.config.max_pending_bytes)
        self._counts = Counters()
        self._keeper = StoreKeeper(
            self.directory, fingerprint, self.config, clock, monotonic, self._counts, self._queue
        )
        self._budget = ByteBudget(self.config.max_bytes, self.config.segment_bytes)
        """Lowered while the filesystem is full (budget.py); the writer's alone to change."""
        self._write_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.events: MediumEvents | None = None
        """Where writes and removals are published (None: KV events off); set before `open`."""

    @property
    def _store(self) -> DiskStore | None:
        return self._keeper.store

    # lifecycle

    def open(self) -> None:
        """Open (or create) the index and segments and start the writer. Never raises: on
        failure the tier stays degraded (every lookup misses) and the writer retries."""
        if self.events is not None:
            self._keeper.on_removed = self.events.removed
        with self._write_lock:
            self._keeper.open()
        self._thread = threading.Thread(target=self._run, name="disk-tier-writer", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (up to `timeout_s`), stop the writer and release the files."""
        self._queue.close()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
            c = self._counts.snapshot()
            logger.info(
                "disk cache closed: %d blocks written, %d offers dropped, %d bytes still queued",
                c["writes"], c["dropped"], self._queue.pending_bytes,
            )  # fmt: skip
        with self._write_lock:
            self._keeper.close()

    # lookups (any thread)

    def contains_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks are on disk (index only; a later `load` may still miss)."""
        with self._keeper.slot.use() as store:
            if store is None:
                return 0
            try:
                return store.contains_prefix(block_hashes)
            except Exception as exc:
                self._keeper.fail("disk cache index read failed", exc)
                return 0

    def load(self, block_hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """Verified payloads, None where absent or damaged (a damaged entry is dropped).
        Blocking file reads: call it from a worker thread, not from an event loop."""
        misses: list[bytes | None] = [None] * len(block_hashes)
        with self._keeper.slot.use() as store:
            if store is None:
                self._counts.add(lookups=len(block_hashes))
                return misses
            try:
                result = store.load(block_hashes)
                dirty = store.index.dirty and not store.readonly
            except Exception as exc:
                self._keeper.fail("disk cache read failed", exc)
                return misses
        return self._loaded(len(block_hashes), result, dirty)

    async def load_async(self, block_hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """`load` for an event loop, which it never blocks (async_reads.py): the same payloads,
        checks and accounting."""
        misses: list[bytes | None] = [None] * len(block_hashes)
        with self._keeper.slot.use() as store:
            if store is None:
                self._counts.add(lookups=len(block_hashes))
                return misses
            try:
                result = await load_records(store, block_hashes)
                dirty = store.index.dirty and not store.readonly
            except Exception as exc:
                self._keeper.fail("disk cache read failed", exc)
                return misses
        return self._loaded(len(block_hashes), result, dirty)

    def _loaded(self, num_lookups: int, result: LoadResult, dirty: bool) -> list[bytes | None]:
        if dirty:  # the writer rebuilds the index (and `flush` waits for it)
            self._queue.offer(PendingHeal())
        hits = sum(p is not None for p in result.payloads)
        self._counts.add(lookups=num_lookups, hits=hits, checksum=result.num_checksum_failures)
        return result.payloads

    # writes (non-blocking: enqueue only)

    def offer(
        self,
        block_hash: BlockHash,
        payload: bytes,
        num_tokens: int,
        retention: str | None = None,
        origin: BlockOrigin | None = None,
    ) -> bool:
        """Queue a full block for writing. False when not queued: `none` retention (not
        counted), or dropped (queue full, degraded, read-only; counted). Unknown retention
        classes raise `InvalidRequestError`. `origin`: what its `BlockStored` event carries
        once written (KV events on)."""
        check_hash(block_hash)
        retention = retention or self.config.default_retention
        ttl_s = self.config.ttl_s(retention)
        if ttl_s is None:
            return False
        item = PendingWrite(block_hash, bytes(payload), num_tokens, retention, ttl_s, origin)
        if self._writable() and self._queue.offer(item):
            return True
        self._counts.add(dropped=1)
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
        """Heal the index if needed, then sweep now (the writer also does both periodically)."""
        with self._write_lock:
            return self._sweep_locked()

    def _writable(self) -> bool:
        store = self._store
        if store is None or store.readonly or self._queue.closed:
            return False
        return not self._keeper.degraded

    # the writer thread

    def _run(self) -> None:
        next_sweep = self.monotonic() + self.config.sweep_interval_s
        while True:
            wait_s = max(0.0, next_sweep - self.monotonic())
            if self._keeper.degraded:
                wait_s = min(wait_s, _POLL_S)
            batch = self._queue.take(self.config.max_batch_blocks, wait_s)
            if not batch and self._queue.closed:
                return
            try:
                with self._write_lock:
                    self._keeper.maintain()
                    self._write_locked(batch)
                    self._keeper.maintain()  # damage the batch met is repaired at once
                    if self.monotonic() >= next_sweep or self._over_budget():
                        self._sweep_locked()
                        next_sweep = self.monotonic() + self.config.sweep_interval_s
            except Exception as exc:  # the writer must outlive anything that goes wrong
                self._keeper.fail("disk cache writer failed", exc)
            finally:
                if batch:
                    self._queue.done(batch)

    def _write_locked(self, batch: list[Pending]) -> None:
        store = self._store
        writes = [p for p in batch if isinstance(p, PendingWrite)]
        touches = [p for p in batch if isinstance(p, PendingTouch)]
        if not writes and not touches:
            return
        if store is None or not self._writable():
            self._counts.add(dropped=len(writes))
            return
        if self._budget.lowered:  # keep out of the headroom: room first, then the batch
            incoming = sum(record_bytes(len(w.payload)) for w in writes)
            if store.disk_bytes() + incoming > self._budget.bytes:
                self._sweep_locked(reserve_bytes=incoming)
        for attempt in range(2):
            try:
                self._apply(store, touches, writes)
                break
            except Exception as exc:
                if attempt == 0 and is_no_space(exc, self.directory) and self._make_room(store):
                    continue  # evicted down to a lowered budget: the batch may fit now
                self._counts.add(dropped=len(writes))
                self._keeper.fail("disk cache write failed; writes are dropped for now", exc)
                return
        self._keeper.succeeded()

    def _apply(
        self, store: DiskStore, touches: list[PendingTouch], writes: list[PendingWrite]
    ) -> None:
        for p in touches:
            store.index.touch_many(p.block_hashes, p.now_s, p.ttl_s, p.retention)
        if writes:
            written = store.write(writes, self.clock())
            self._counts.add(writes=len(written))
            if self.events is not None:
                for w in written:
                    if w.origin is not None:
                        self.events.stored_one(w.block_hash, w.origin)

    def _make_room(self, store: DiskStore) -> bool:
        """A write found the filesystem full: lower the budget below what is held, shed whole
        segments down to it, then sweep within it (budget.py). Returns whether anything was
        freed (then the write is worth retrying)."""
        self._counts.add(no_space=1)
        try:
            before = self._budget.bytes
            after = self._budget.lower(store.disk_bytes(), free_bytes(self.directory))
            if after < before:
                logger.warning(
                    "disk cache filesystem is full (%s): budget lowered from %d to %d bytes",
                    self.directory, before, after,
                )  # fmt: skip
            shed = store.shed(after)
        except Exception as exc:
            self._keeper.fail("disk cache could not make room on a full filesystem", exc)
            return False
        self._counts.add(evictions=shed.num_evicted)
        swept = self._sweep_locked(follow=False)
        return swept is not None and shed.num_freed + swept.num_freed > 0

    def _over_budget(self) -> bool:
        store = self._store
        try:
            budget = self._budget.bytes - self.config.segment_bytes
            return store is not None and store.closed_bytes() > budget
        except Exception:
            return False

    def _sweep_locked(self, follow: bool = True, reserve_bytes: int = 0) -> SweepResult | None:
        """Heal if needed, then sweep within the budget less `reserve_bytes` (room for a batch
        about to be written); `follow`: first set a lowered budget again from the space the
        filesystem has now."""
        store = self._store
        if store is None or store.readonly:
            return None
        try:
            healed = store.heal(full=False)
            if follow and self._budget.lowered:
                self._follow_space(store)
            budget = max(self._budget.min_bytes, self._budget.bytes - reserve_bytes)
            result = store.sweep(self.clock(), budget)
        except Exception as exc:
            self._keeper.fail("disk cache sweep failed", exc)
            return None
        self._counts.add(
            evictions=result.num_evicted, expirations=result.num_expired, repairs=int(healed)
        )
        return result

    def _follow_space(self, store: DiskStore) -> None:
        before = self._budget.bytes
        after = self._budget.follow(store.disk_bytes(), free_bytes(self.directory))
        if after == self._budget.max_bytes and before < after:
            logger.info(
                "disk cache %s has room again: budget back to %d bytes", self.directory, after
            )

    # checks and accounting

    def repair(self) -> int:
        """Check the whole index now (rebuilding it if its tables disagree) and drop records
        that fail verification, with writing paused (O(data): for tests and offline checks).
        Returns the records dropped for failing verification."""
        with self._write_lock:
            self._keeper.check_needed = True
            self._keeper.maintain()
            store = self._store
            if store is None or store.readonly:
                return 0
            try:
                bad: list[BlockHash] = []
                store.verify_all(bad.append)
                dropped = len(store.index.remove_many(bad))
            except Exception as exc:
                self._keeper.fail("disk cache repair failed", exc)
                self._keeper.maintain()  # a damaged index is reset now
                return 0
        self._counts.add(checksum=dropped)
        return dropped

    @property
    def degraded(self) -> bool:
        return self._keeper.degraded

    def stats(self) -> DiskTierStats:
        num_blocks = live = disk = 0
        with self._keeper.slot.use() as store:
            try:
                if store is not None:
                    num_blocks = store.index.num_blocks()
                    live, disk = store.byte_counts()
            except Exception as exc:
                self._keeper.fail("disk cache index read failed", exc)
        return make_stats(
            self._counts.snapshot(), num_blocks, live, disk, self._queue.pending_bytes,
            self.degraded, readonly=store is not None and store.readonly,
            budget_bytes=self._budget.bytes,
        )  # fmt: skip

    def summary(self) -> DiskSummary:
        """Blocks, tokens, bytes and expiry per retention class, and the segment count: a scan of
        the whole index (blocking, O(entries): call it from a worker thread, now and then).
        Degraded: every class empty."""
        retention_s = self.config.retention_s
        with self._keeper.slot.use() as store:
            try:
                if store is not None:
                    return summarize(store.index, retention_s, self.config.max_bytes)
            except Exception as exc:
                self._keeper.fail("disk cache index read failed", exc)
        empty = tuple(ClassSummary(name, ttl) for name, ttl in retention_s)
        return DiskSummary(empty, 0, self.config.max_bytes)

    def verify_all(self) -> int:
        """Read and verify every indexed record, with writing paused (O(data): for tests and
        offline checks). Returns how many failed (they are not dropped)."""
        with self._write_lock:
            store = self._store
            try:
                return 0 if store is None else store.verify_all()
            except Exception as exc:
                self._keeper.fail("disk cache verification failed", exc)
                return 0

    def check_integrity(self) -> None:
        """Index tables consistent with each other and with the segment accounting; the budget
        within its bounds."""
        with self._write_lock:
            self._budget.check_integrity()
            if self._store is not None:
                self._store.check_integrity()
