"""`DiskStore`: segments and index composed, synchronously; the crash-safety rules live here.

Write order: a segment is registered in the index before its file exists; payloads are appended
and fsynced before the index transaction naming them commits; an entry is removed from the index
before its segment file is deleted. So after a crash at any point, every index entry points at
durable bytes, and the only leftovers are unindexed bytes (reclaimed with their segment) or files
the index does not know (deleted at open). One exception: on a full filesystem `shed` deletes a
file before its entries (an index commit needs free space); a crash in between leaves entries
whose file is missing, which `recover` drops at open.

Damage (a record that fails to decode or to verify, tables that disagree) is a miss, never an
error or a wrong payload: `load` drops what fails, and `heal` rebuilds the index when it is dirty.

Not thread-safe for writers: one thread at a time may call `write`, `sweep`, `recover` and `heal`
(the tier's writer lock). `load` and `contains_prefix` may run on any thread concurrently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import lmdb
import msgspec

from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.free_queue import IntegrityError
from deepinfer.kv_events.recorder import BlockOrigin
from deepinfer.tiers.disk.budget import is_no_space
from deepinfer.tiers.disk.config import DiskTierConfig
from deepinfer.tiers.disk.index import CORRUPT, BlockIndex
from deepinfer.tiers.disk.records import BlockRecord, time_key
from deepinfer.tiers.disk.segments import RawRecord, SegmentStore, parse_record, record_bytes

SWEEP_BATCH = 256


@dataclass(frozen=True)
class PendingWrite:
    """A full block offered to the disk tier, waiting in the write-behind queue."""

    block_hash: BlockHash
    payload: bytes
    num_tokens: int
    retention: str
    ttl_s: float
    origin: BlockOrigin | None = None
    """What its `BlockStored` event carries (KV events on)."""


@dataclass(frozen=True)
class SweepResult:
    num_expired: int
    num_evicted: int
    num_segments_reclaimed: int

    @property
    def num_freed(self) -> int:
        """Entries and segment files dropped: nonzero when the sweep gave disk space back."""
        return self.num_expired + self.num_evicted + self.num_segments_reclaimed


@dataclass(frozen=True)
class LoadResult:
    payloads: list[bytes | None]
    num_checksum_failures: int


def _template(w: PendingWrite, now_s: float) -> BlockRecord:
    """A new block's record, less its location (filled in when appended)."""
    return BlockRecord(
        0, 0, len(w.payload), b"", w.num_tokens, now_s, now_s, w.retention, now_s + w.ttl_s
    )


def _ignore(num: int) -> None:
    del num


class DiskStore:
    def __init__(
        self,
        directory: Path,
        config: DiskTierConfig,
        readonly: bool = False,
        on_corrupt: Callable[[int], None] = _ignore,
    ) -> None:
        """`on_corrupt(n)`: `n` index entries failed to decode (dropped unless read-only)."""
        self.config = config
        self.readonly = readonly
        seg_dir = directory / "segments"
        if not readonly:
            seg_dir.mkdir(parents=True, exist_ok=True)
        self.segments = SegmentStore(seg_dir, config.segment_bytes)
        self.index = BlockIndex(directory / "index", config.map_bytes(), readonly, on_corrupt)

    def close(self) -> None:
        self.segments.close()
        self.index.close()

    def recover(self) -> int:
        """Reconcile files and index after open (writer only; `heal` runs it again after a
        rebuild). Returns files/segments dropped. Files the index does not know (a crash before
        indexing, an index rebuilt empty) are deleted: that is how unindexed bytes come back."""
        known, on_disk = self.index.segments(), set(self.segments.list_segments())
        if self.index.dirty:  # a damaged `segments` entry may hide a live file: heal first
            return 0
        dropped = 0
        for segment in on_disk - set(known):
            self.segments.delete(segment)  # created by a process that crashed before indexing
            dropped += 1
        for segment, info in known.items():
            if segment not in on_disk or info.num_live == 0:
                self._drop_segment(segment)
                dropped += 1
            elif (size := self.segments.file_bytes(segment)) != info.size_bytes:
                self.index.put_many([], segment, size)  # an unindexed (possibly torn) tail
        return dropped

    def contains_prefix(self, hashes: Sequence[BlockHash]) -> int:
        return self.index.contains_prefix(hashes)

    def load(self, hashes: Sequence[BlockHash]) -> LoadResult:
        """Payloads (None: absent, damaged or failed verification; a failed entry is dropped)."""
        records = self.locate(hashes)
        raws = [
            None if r is None else self.segments.read_raw(r.segment, r.offset, r.length)
            for r in records
        ]
        return self.verify(hashes, records, raws)

    def locate(self, hashes: Sequence[BlockHash]) -> list[BlockRecord | None]:
        """`load`'s first step: each block's index record (None: absent, or undecodable, which
        is dropped, or only counted when read-only). Then read the records and `verify` them."""
        found = self.index.read_many(hashes)
        corrupt = [h for h, r in zip(hashes, found, strict=True) if r is CORRUPT]
        if corrupt and self.readonly:
            self.index.on_corrupt(len(corrupt))
        elif corrupt:
            self.index.drop_corrupt(corrupt)
        return [r if isinstance(r, BlockRecord) else None for r in found]

    def verify(
        self,
        hashes: Sequence[BlockHash],
        records: Sequence[BlockRecord | None],
        raws: Sequence[RawRecord | None],
    ) -> LoadResult:
        """`load`'s last step: check each record as read (`raws`, None where unreadable) against
        its index record; an entry that fails, if still indexed, is dropped."""
        out: list[bytes | None] = []
        failures = 0
        for block_hash, record, raw in zip(hashes, records, raws, strict=True):
            if record is None:
                out.append(None)
                continue
            payload = None
            if raw is not None:
                payload = parse_record(raw, record.length, block_hash, record.checksum)
            if payload is None and self._still_indexed(block_hash, record):
                failures += 1
                if not self.readonly:
                    self.index.remove_many([block_hash])
            out.append(payload)
        return LoadResult(out, failures)

    def _read(self, block_hash: BlockHash, r: BlockRecord) -> bytes | None:
        return self.segments.read(r.segment, r.offset, r.length, block_hash, r.checksum)

    def _still_indexed(self, block_hash: BlockHash, record: BlockRecord) -> bool:
        """False when a concurrent reclaim removed the entry (and its file) while we read."""
        now = self.index.get_many([block_hash])[0]
        return now is not None and (now.segment, now.offset) == (record.segment, record.offset)

    def write(self, items: Sequence[PendingWrite], now_s: float) -> list[PendingWrite]:
        """Append, fsync, then index `items` (already-present hashes are only touched).
        Returns the items written. Raises OSError / lmdb.Error with nothing partial indexed."""
        existing = self.index.get_many([w.block_hash for w in items])
        fresh: dict[BlockHash, PendingWrite] = {}
        for w, rec in zip(items, existing, strict=True):
            if rec is None:
                fresh.setdefault(w.block_hash, w)
            else:
                self.index.touch_many([w.block_hash], now_s, w.ttl_s, w.retention)
        self._append_all([(w.block_hash, w.payload, _template(w, now_s)) for w in fresh.values()])
        return list(fresh.values())

    def _append_all(self, items: Sequence[tuple[BlockHash, bytes, BlockRecord]]) -> None:
        """Append payloads (rotating segments as they fill), fsync, then index each group with
        its template record's metadata."""
        group: list[tuple[BlockHash, BlockRecord]] = []
        for block_hash, payload, template in items:
            if self.segments.is_full():
                self._commit(group)
                group = []
                self._start_segment()
            group.append((block_hash, self._append(block_hash, payload, template)))
        self._commit(group)

    def _append(self, block_hash: BlockHash, payload: bytes, template: BlockRecord) -> BlockRecord:
        segment, start = self.segments.active, self.segments.active_size
        assert segment is not None
        try:
            offset, _, digest = self.segments.append(block_hash, payload)
        except OSError:
            self.segments.truncate_to(start)
            raise
        return msgspec.structs.replace(template, segment=segment, offset=offset, checksum=digest)

    def _commit(self, group: list[tuple[BlockHash, BlockRecord]]) -> None:
        if not group:
            return
        segment = group[0][1].segment
        self.segments.sync()
        self.index.put_many(group, segment, self.segments.active_size)

    def _start_segment(self) -> None:
        ids = set(self.index.segments()) | set(self.segments.list_segments())
        self.segments.start(self.index.new_segment(max(ids, default=0) + 1))

    def sweep(self, now_s: float, budget_bytes: int | None = None) -> SweepResult:
        """Drop expired entries, evict least recently used ones beyond the byte budget
        (`budget_bytes`, default `max_bytes`: segment files, the active one counted as full), and
        reclaim closed segments whose live fraction fell below the threshold."""
        expired = 0
        while batch := self.index.first_keys("expiry", SWEEP_BATCH, below=time_key(now_s, b"")):
            expired += len(self.index.remove_many(batch))
        evicted, reclaimed = self._reclaim()
        budget = (budget_bytes or self.config.max_bytes) - self.config.segment_bytes
        while (excess := self.closed_bytes() - budget) > 0:
            num = self._evict_lru(excess)
            if num == 0:
                break
            evicted += num
            more_evicted, more_reclaimed = self._reclaim()
            evicted, reclaimed = evicted + more_evicted, reclaimed + more_reclaimed
        return SweepResult(expired, evicted, reclaimed)

    def _evict_lru(self, num_bytes: int) -> int:
        """Drop least recently used entries holding at least `num_bytes` live bytes (fewer when
        the index runs out). Returns entries dropped."""
        chosen: list[BlockHash] = []
        batch = self.index.first_keys("lru", SWEEP_BATCH)
        for block_hash, record in zip(batch, self.index.get_many(batch), strict=True):
            if num_bytes <= 0:
                break
            chosen.append(block_hash)
            if record is None:  # an `lru` entry without its block: the tables disagree
                self.index.dirty = True
            num_bytes -= 0 if record is None else record_bytes(record.length)
        return len(self.index.remove_many(chosen))

    def _reclaim(self) -> tuple[int, int]:
        """(entries dropped, segments deleted) for closed segments below the live threshold.
        A segment whose live records find no room to move to (the filesystem is full) is
        dropped with them: deleting it is what gives the space back."""
        dropped = segments = 0
        for segment, info in self.index.segments().items():
            if segment == self.segments.active:
                continue
            if info.live_bytes < self.config.reclaim_live_fraction * info.size_bytes or (
                info.num_live == 0
            ):
                try:
                    dropped += self._relocate(segment)
                except (OSError, lmdb.Error) as exc:
                    if not is_no_space(exc, self.segments.directory):
                        raise
                dropped += self._drop_segment(segment)
                segments += 1
        return dropped, segments

    def shed(self, budget_bytes: int) -> SweepResult:
        """Bring the segment files within `budget_bytes` (the active one counted as full) on a
        full filesystem: whole closed segments, oldest first, each file deleted before its index
        entries, since removing them takes an index commit and that takes free space. An entry
        a commit still fails to remove names a missing file: a miss, dropped by the next read,
        sweep or open."""
        infos = self.index.segments()
        closed = sorted(s for s in infos if s != self.segments.active)
        excess = sum(infos[s].size_bytes for s in closed) - (
            budget_bytes - self.config.segment_bytes
        )
        evicted = segments = 0
        for segment in closed:
            if excess <= 0:
                break
            self.segments.delete(segment)
            excess -= infos[segment].size_bytes
            evicted += self._drop_segment(segment)
            segments += 1
        return SweepResult(0, evicted, segments)

    def _relocate(self, segment: int) -> int:
        """Copy a segment's live records to the active segment, keeping their metadata (so the
        LRU order and expiry survive compaction). Returns records that failed to verify."""
        hashes = self.index.hashes_in(segment)
        items, bad = [], []
        for block_hash, record in zip(hashes, self.index.get_many(hashes), strict=True):
            payload = None if record is None else self._read(block_hash, record)
            if record is not None and payload is None:
                bad.append(block_hash)
            elif record is not None and payload is not None:
                items.append((block_hash, payload, record))
        self._append_all(items)
        return len(self.index.remove_many(bad))

    def _drop_segment(self, segment: int) -> int:
        dropped = len(self.index.remove_many(self.index.hashes_in(segment)))
        self.index.remove_segment(segment)
        self.segments.delete(segment)
        return dropped

    def closed_bytes(self) -> int:
        """Bytes of segment files other than the active one."""
        active = self.segments.active
        return sum(i.size_bytes for s, i in self.index.segments().items() if s != active)

    def disk_bytes(self) -> int:
        return self.byte_counts()[1]

    def live_bytes(self) -> int:
        return self.byte_counts()[0]

    def byte_counts(self) -> tuple[int, int]:
        """(live bytes, bytes in segment files), from one read of the segments table."""
        segments = self.index.segments().values()
        return sum(i.live_bytes for i in segments), sum(i.size_bytes for i in segments)

    def verify_all(self, on_bad: Callable[[BlockHash], None] | None = None) -> int:
        """Read and verify every indexed record (O(data): tests and offline checks).
        Returns how many failed."""
        bad = 0
        for segment in self.index.segments():
            for block_hash in self.index.hashes_in(segment):
                record = self.index.read_many([block_hash])[0]
                if record is CORRUPT or (
                    isinstance(record, BlockRecord) and self._read(block_hash, record) is None
                ):
                    bad += 1
                    if on_bad is not None:
                        on_bad(block_hash)
        return bad

    def heal(self, full: bool) -> bool:
        """Rebuild the index when it is dirty or (`full`: O(entries)) fails its check, then
        reconcile the files with it. Returns whether a rebuild ran. Writing resumes in a fresh
        segment afterwards."""
        if full and not self.index.dirty:
            try:
                self.index.check_integrity()
            except IntegrityError:
                self.index.dirty = True
        if not self.index.dirty:
            return False
        self.segments.close()
        self.index.rebuild()
        self.recover()
        return True

    def check_integrity(self) -> None:
        self.index.check_integrity()
