"""`BlockIndex`: the LMDB index of the disk tier (block hash -> where and until when).

Every method is one synchronous transaction (microseconds for reads; a write commits with an
fsync), so callers on an event loop must run them in an executor. LMDB serialises write
transactions itself; reads never block writes. The invariants `check_integrity` verifies:
each `blocks` entry has exactly one `lru`, one `expiry` and one `by_segment` entry matching it,
and each segment's live bytes and count equal the sum over its entries.

Damaged entries never raise: a `blocks` entry that fails to decode reads as `CORRUPT` (and
a write transaction that meets one deletes it, reporting it to `on_corrupt`); any disagreement
noticed between the tables sets `dirty`, and `rebuild` then derives every other table from
`blocks` again: one write transaction over every entry (O(entries): about a second per few
hundred thousand blocks), run by the tier's writer after damage was noticed, never on a
request's path. Payloads are verified against their checksums on every read, so
a stale or damaged entry costs a miss, never a wrong block. Every transaction starts with a check
of the files LMDB maps (index_files.py): one truncated or replaced under the mapping raises
`IndexFileChangedError` instead of faulting the process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Final

import lmdb
import msgspec

from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.free_queue import require
from deepinfer.tiers.disk.index_files import MappedFiles
from deepinfer.tiers.disk.records import (
    MAX_SEGMENT_ID,
    NEXT_SEGMENT,
    BlockRecord,
    SegmentInfo,
    encode,
    hash_of_time_key,
    segment_key,
    time_key,
    try_decode_record,
    try_decode_segment,
    try_segment_of_key,
)
from deepinfer.tiers.disk.segments import record_bytes

_TABLES = (b"blocks", b"lru", b"expiry", b"segments", b"by_segment", b"meta")


class Corrupt:
    """Marks a `blocks` entry whose key or record failed to decode."""


CORRUPT: Final = Corrupt()


def _ignore(num: int) -> None:
    del num


class BlockIndex:
    def __init__(
        self,
        path: Path,
        map_bytes: int,
        readonly: bool = False,
        on_corrupt: Callable[[int], None] = _ignore,
    ) -> None:
        """`on_corrupt(n)`: called after a write transaction deleted `n` damaged entries."""
        if not readonly:
            path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(
            str(path),
            map_size=map_bytes,
            max_dbs=len(_TABLES),
            readonly=readonly,
            sync=True,
            metasync=True,
            readahead=False,
            max_readers=512,
        )
        self.readonly = readonly
        self.on_corrupt = on_corrupt
        self.on_removed: Callable[[list[BlockHash]], None] | None = None
        """Told, after each commit, of the entries it removed (KV events; None: off)."""
        self.dirty = False
        """Set when tables were seen to disagree (or a damaged entry was dropped, leaving its
        derived entries behind): `rebuild` restores the invariants."""
        try:
            self.files = MappedFiles(path, self.env, readonly)
        except BaseException:
            self.env.close()
            raise
        try:
            opened = {name: self.env.open_db(name, create=not readonly) for name in _TABLES}
        except BaseException:
            self.close()
            raise
        self.blocks, self.lru, self.expiry = opened[b"blocks"], opened[b"lru"], opened[b"expiry"]
        self.segments_db, self.by_segment = opened[b"segments"], opened[b"by_segment"]
        self.meta = opened[b"meta"]

    def close(self) -> None:
        self.files.restore()
        try:
            self.env.close()
        finally:
            self.files.close()

    def begin(
        self, write: bool = False, db: lmdb._Database | None = None
    ) -> lmdb.Transaction[bytes]:
        """A transaction, once the mapped files are checked (`IndexFileChangedError` if one
        was truncated or replaced: nothing is read from the mapping then)."""
        self.files.check()
        return self.env.begin(db=db, write=write)

    # reads

    def read_many(self, hashes: Sequence[BlockHash]) -> list[BlockRecord | Corrupt | None]:
        """Records, None where absent, `CORRUPT` where the entry fails to decode."""
        with self.begin(db=self.blocks) as txn:
            raw = [txn.get(h) for h in hashes]
        out: list[BlockRecord | Corrupt | None] = []
        for block_hash, value in zip(hashes, raw, strict=True):
            record = None if value is None else try_decode_record(block_hash, value)
            out.append(CORRUPT if value is not None and record is None else record)
        return out

    def get_many(self, hashes: Sequence[BlockHash]) -> list[BlockRecord | None]:
        """Records, None where absent or damaged."""
        return [r if isinstance(r, BlockRecord) else None for r in self.read_many(hashes)]

    def contains_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading hashes have an entry (presence only: a read may still fail)."""
        n = 0
        with self.begin(db=self.blocks) as txn:
            for h in hashes:
                if txn.get(h) is None:
                    break
                n += 1
        return n

    def first_keys(self, table: str, limit: int, below: bytes | None = None) -> list[BlockHash]:
        """Hashes of the first `limit` entries of `lru` (least recent first) or `expiry` (soonest
        first), stopping at keys >= `below`. Damaged keys are skipped (and mark the index dirty)."""
        db = self.lru if table == "lru" else self.expiry
        out: list[BlockHash] = []
        with self.begin(db=db) as txn:
            for key in txn.cursor().iternext(keys=True, values=False):
                if len(out) >= limit or (below is not None and key >= below):
                    break
                block_hash = hash_of_time_key(key)
                if block_hash is None:
                    self.dirty = True
                else:
                    out.append(block_hash)
        return out

    def segments(self) -> dict[int, SegmentInfo]:
        """Registered segments; damaged entries are left out (and mark the index dirty)."""
        with self.begin(db=self.segments_db) as txn:
            items = list(txn.cursor().iternext())
        out = {}
        for key, value in items:
            decoded = try_decode_segment(key, value)
            if decoded is None:
                self.dirty = True
            else:
                out[decoded[0]] = decoded[1]
        return out

    def hashes_in(self, segment: int) -> list[BlockHash]:
        prefix = segment_key(segment)
        out = []
        with self.begin(db=self.by_segment) as txn:
            cursor = txn.cursor()
            if cursor.set_range(prefix):
                for key in cursor.iternext(keys=True, values=False):
                    if not key.startswith(prefix):
                        break
                    out.append(bytes(key[len(prefix) :]))
        return out

    def num_blocks(self) -> int:
        with self.begin() as txn:
            return int(txn.stat(self.blocks)["entries"])

    # writes

    def new_segment(self, at_least: int) -> int:
        """Register a new, empty segment (before its file is created, so it is never orphaned).
        Ids only grow (never reused, even after every segment was reclaimed), and are at least
        `at_least` (the caller passes one more than the largest id it saw on disk)."""
        with self.begin(write=True) as txn:
            raw = txn.get(NEXT_SEGMENT, db=self.meta)
            stored = None if raw is None else try_segment_of_key(raw)
            segment = max(at_least, 1 if stored is None else stored)
            txn.put(NEXT_SEGMENT, segment_key(segment + 1), db=self.meta)
            txn.put(segment_key(segment), encode(SegmentInfo(0, 0, 0)), db=self.segments_db)
        return segment

    def put_many(
        self, entries: Iterable[tuple[BlockHash, BlockRecord]], segment: int, size_bytes: int
    ) -> None:
        """Commit records (their bytes already durable) and the active segment's new size."""
        num_corrupt = 0
        with self.begin(write=True) as txn:
            for block_hash, record in entries:
                old = self._record(txn, block_hash)
                if isinstance(old, BlockRecord):
                    self._delete(txn, block_hash, old)
                num_corrupt += old is CORRUPT
                self._insert(txn, block_hash, record)
            info = self._segment(txn, segment)
            self._put_segment(txn, segment, SegmentInfo(size_bytes, info.live_bytes, info.num_live))
        self._report(num_corrupt)

    def touch_many(
        self, hashes: Iterable[BlockHash], now_s: float, ttl_s: float, retention: str
    ) -> int:
        """A hit: last access = now, expiry = max(old, now + ttl). Returns entries updated."""
        n = num_corrupt = 0
        dropped: list[BlockHash] = []
        with self.begin(write=True) as txn:
            for block_hash in hashes:
                old = self._record(txn, block_hash)
                num_corrupt += old is CORRUPT
                if old is CORRUPT:
                    dropped.append(block_hash)
                if not isinstance(old, BlockRecord):
                    continue
                expires_s, keep = now_s + ttl_s, old.expires_s > now_s + ttl_s
                new = _replace(
                    old,
                    last_access_s=max(now_s, old.last_access_s),
                    expires_s=old.expires_s if keep else expires_s,
                    retention=old.retention if keep else retention,
                )
                self._delete(txn, block_hash, old)
                self._insert(txn, block_hash, new)
                n += 1
        self._report(num_corrupt)
        self._removed(dropped)
        return n

    def remove_many(self, hashes: Iterable[BlockHash]) -> list[BlockRecord]:
        """Drop entries (absent ones are skipped, damaged ones deleted and reported); returns
        the records removed."""
        removed, num_corrupt = [], 0
        dropped: list[BlockHash] = []
        with self.begin(write=True) as txn:
            for block_hash in hashes:
                record = self._record(txn, block_hash)
                num_corrupt += record is CORRUPT
                if isinstance(record, BlockRecord):
                    self._delete(txn, block_hash, record)
                    removed.append(record)
                if record is not None:
                    dropped.append(block_hash)
        self._report(num_corrupt)
        self._removed(dropped)
        return removed

    def drop_corrupt(self, hashes: Iterable[BlockHash]) -> int:
        """Delete the entries among `hashes` that (still) fail to decode. Returns how many."""
        dropped: list[BlockHash] = []
        with self.begin(write=True) as txn:
            for block_hash in hashes:
                if self._record(txn, block_hash) is CORRUPT:
                    dropped.append(block_hash)
        self._report(len(dropped))
        self._removed(dropped)
        return len(dropped)

    def remove_segment(self, segment: int) -> None:
        """Forget a segment whose entries are all gone (its file is deleted next). Accounting
        that says otherwise means the tables disagree: the index is marked dirty."""
        with self.begin(write=True, db=self.segments_db) as txn:
            info = self._segment(txn, segment)
            if info.num_live or info.live_bytes:
                self.dirty = True
            txn.delete(segment_key(segment))

    def _record(self, txn: lmdb.Transaction, block_hash: BlockHash) -> BlockRecord | Corrupt | None:
        """The entry of `block_hash`; a damaged one is deleted here (its derived entries are
        left for `rebuild`) and returned as `CORRUPT`."""
        raw = txn.get(block_hash, db=self.blocks)
        if raw is None:
            return None
        record = try_decode_record(block_hash, raw)
        if record is not None:
            return record
        txn.delete(block_hash, db=self.blocks)
        self.dirty = True
        return CORRUPT

    def _insert(self, txn: lmdb.Transaction, block_hash: BlockHash, record: BlockRecord) -> None:
        txn.put(block_hash, encode(record), db=self.blocks)
        self.put_derived(txn, block_hash, record)
        info = self._segment(txn, record.segment)
        live = info.live_bytes + record_bytes(record.length)
        self._put_segment(
            txn, record.segment, SegmentInfo(info.size_bytes, live, info.num_live + 1)
        )

    def put_derived(self, txn: lmdb.Transaction, block_hash: BlockHash, r: BlockRecord) -> None:
        """The `lru`, `expiry` and `by_segment` entries of one record."""
        txn.put(time_key(r.last_access_s, block_hash), b"", db=self.lru)
        txn.put(time_key(r.expires_s, block_hash), b"", db=self.expiry)
        txn.put(segment_key(r.segment) + block_hash, b"", db=self.by_segment)

    def _delete(self, txn: lmdb.Transaction, block_hash: BlockHash, record: BlockRecord) -> None:
        txn.delete(block_hash, db=self.blocks)
        found = [
            txn.delete(time_key(record.last_access_s, block_hash), db=self.lru),
            txn.delete(time_key(record.expires_s, block_hash), db=self.expiry),
            txn.delete(segment_key(record.segment) + block_hash, db=self.by_segment),
        ]
        info = self._segment(txn, record.segment)
        live = info.live_bytes - record_bytes(record.length)
        if not all(found) or live < 0 or info.num_live < 1:
            self.dirty = True
        self._put_segment(
            txn,
            record.segment,
            SegmentInfo(info.size_bytes, max(0, live), max(0, info.num_live - 1)),
        )

    def _segment(self, txn: lmdb.Transaction, segment: int) -> SegmentInfo:
        raw = txn.get(segment_key(segment), db=self.segments_db)
        decoded = None if raw is None else try_decode_segment(segment_key(segment), raw)
        if raw is not None and decoded is None:
            self.dirty = True
        return SegmentInfo(0, 0, 0) if decoded is None else decoded[1]

    def _put_segment(self, txn: lmdb.Transaction, segment: int, info: SegmentInfo) -> None:
        txn.put(segment_key(segment), encode(info), db=self.segments_db)

    def rebuild(self) -> int:
        """Derive every table from `blocks` again, dropping damaged entries; clears `dirty`.
        Returns entries dropped."""
        dropped = self._rebuild_tables()
        self.dirty = False
        self._report(len(dropped))
        self._removed(dropped)
        return len(dropped)

    def check_integrity(self) -> None:
        """The tables mirror each other and the segment accounting adds up (O(entries))."""
        self._check_tables()

    def _rebuild_tables(self) -> list[BlockHash]:
        """Drop `blocks` entries that fail to decode and derive the other tables from the rest.
        Segment sizes are kept where they decode (`DiskStore.recover` corrects them from the files).
        Returns the keys of the entries dropped."""
        with self.begin(write=True) as txn:
            sizes = self._segment_sizes(txn)
            for db in (self.lru, self.expiry, self.by_segment, self.segments_db):
                txn.drop(db, delete=False)
            bad: list[bytes] = []
            live: dict[int, tuple[int, int]] = {}
            for key, raw in txn.cursor(db=self.blocks).iternext():
                record = try_decode_record(key, raw)
                if record is None:
                    bad.append(bytes(key))
                    continue
                self.put_derived(txn, key, record)
                num_bytes, num = live.get(record.segment, (0, 0))
                live[record.segment] = (num_bytes + record_bytes(record.length), num + 1)
            for key in bad:
                txn.delete(key, db=self.blocks)
            for segment in sizes.keys() | live.keys():
                num_bytes, num = live.get(segment, (0, 0))
                info = SegmentInfo(sizes.get(segment, 0), num_bytes, num)
                txn.put(segment_key(segment), encode(info), db=self.segments_db)
            self._repair_next_segment(txn, max(sizes.keys() | live.keys(), default=0))
        return bad

    def _segment_sizes(self, txn: lmdb.Transaction) -> dict[int, int]:
        sizes = {}
        for key, raw in txn.cursor(db=self.segments_db).iternext():
            decoded = try_decode_segment(key, raw)
            if decoded is not None:
                sizes[decoded[0]] = decoded[1].size_bytes
        return sizes

    def _repair_next_segment(self, txn: lmdb.Transaction, max_segment: int) -> None:
        """Segment ids only grow: the counter must exceed every id registered."""
        raw = txn.get(NEXT_SEGMENT, db=self.meta)
        stored = None if raw is None else try_segment_of_key(raw)
        if stored is None or stored <= max_segment:
            txn.put(NEXT_SEGMENT, segment_key(min(max_segment + 1, MAX_SEGMENT_ID)), db=self.meta)

    def _check_tables(self) -> None:
        """The tables mirror each other and the segment accounting adds up (O(entries))."""
        live: dict[int, list[int]] = {}
        with self.begin() as txn:
            for key, raw in txn.cursor(db=self.blocks).iternext():
                r = try_decode_record(key, raw)
                require(r is not None, f"entry {key.hex()[:12]} does not decode")
                assert r is not None
                for db, k in (
                    (self.lru, time_key(r.last_access_s, key)),
                    (self.expiry, time_key(r.expires_s, key)),
                    (self.by_segment, segment_key(r.segment) + key),
                ):
                    require(txn.get(k, db=db) is not None, f"entry {key.hex()[:12]} lacks {db}")
                acc = live.setdefault(r.segment, [0, 0])
                acc[0], acc[1] = acc[0] + record_bytes(r.length), acc[1] + 1
            n = int(txn.stat(self.blocks)["entries"])
            for db in (self.lru, self.expiry, self.by_segment):
                require(int(txn.stat(db)["entries"]) == n, "index tables differ in size")
            for k, v in txn.cursor(db=self.segments_db).iternext():
                decoded = try_decode_segment(k, v)
                require(decoded is not None, f"segment entry {k.hex()} does not decode")
                assert decoded is not None
                segment, info = decoded
                acc = live.pop(segment, [0, 0])
                require(
                    (info.live_bytes, info.num_live) == tuple(acc),
                    f"segment {segment} accounting {info} != {acc}",
                )
        require(not live, f"entries point at unregistered segments {sorted(live)}")

    def _removed(self, block_hashes: list[BlockHash]) -> None:
        if block_hashes and self.on_removed is not None:
            self.on_removed(block_hashes)

    def _report(self, num_corrupt: int) -> None:
        if num_corrupt:
            self.on_corrupt(num_corrupt)


def _replace(record: BlockRecord, **changes: object) -> BlockRecord:
    return msgspec.structs.replace(record, **changes)
