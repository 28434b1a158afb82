"""`BlockIndex`: the LMDB index of the disk tier (block hash -> where and until when).

Every method is one synchronous transaction (microseconds for reads; a write commits with an
fsync), so callers on an event loop must run them in an executor. LMDB serialises write
transactions itself; reads never block writes. The invariants `check_integrity` verifies:
each `blocks` entry has exactly one `lru`, one `expiry` and one `by_segment` entry matching it,
and each segment's live bytes and count equal the sum over its entries.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import lmdb
import msgspec

from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.disk.records import (
    BlockRecord,
    SegmentInfo,
    decode_record,
    decode_segment,
    encode,
    hash_of_time_key,
    segment_key,
    segment_of_key,
    time_key,
)
from deepinfer.cache.disk.segments import record_bytes
from deepinfer.cache.free_queue import require

_TABLES = (b"blocks", b"lru", b"expiry", b"segments", b"by_segment", b"meta")
_NEXT_SEGMENT = b"next_segment"


class BlockIndex:
    def __init__(self, path: Path, map_bytes: int, readonly: bool = False) -> None:
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
        opened = {name: self.env.open_db(name, create=not readonly) for name in _TABLES}
        self._blocks, self._lru, self._expiry = opened[b"blocks"], opened[b"lru"], opened[b"expiry"]
        self._segments, self._by_seg = opened[b"segments"], opened[b"by_segment"]
        self._meta = opened[b"meta"]

    def close(self) -> None:
        self.env.close()

    # reads

    def get_many(self, hashes: Sequence[BlockHash]) -> list[BlockRecord | None]:
        with self.env.begin(db=self._blocks) as txn:
            raw = [txn.get(h) for h in hashes]
        return [None if r is None else decode_record(r) for r in raw]

    def contains_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading hashes have an entry (presence only: a read may still fail)."""
        n = 0
        with self.env.begin(db=self._blocks) as txn:
            for h in hashes:
                if txn.get(h) is None:
                    break
                n += 1
        return n

    def first_keys(self, table: str, limit: int, below: bytes | None = None) -> list[BlockHash]:
        """Hashes of the first `limit` entries of `lru` (least recent first) or `expiry` (soonest
        first), stopping at keys >= `below`."""
        db = self._lru if table == "lru" else self._expiry
        out: list[BlockHash] = []
        with self.env.begin(db=db) as txn:
            for key in txn.cursor().iternext(keys=True, values=False):
                if len(out) >= limit or (below is not None and key >= below):
                    break
                out.append(hash_of_time_key(key))
        return out

    def segments(self) -> dict[int, SegmentInfo]:
        with self.env.begin(db=self._segments) as txn:
            items = list(txn.cursor().iternext())
        return {segment_of_key(k): decode_segment(v) for k, v in items}

    def hashes_in(self, segment: int) -> list[BlockHash]:
        prefix = segment_key(segment)
        out = []
        with self.env.begin(db=self._by_seg) as txn:
            cursor = txn.cursor()
            if cursor.set_range(prefix):
                for key in cursor.iternext(keys=True, values=False):
                    if not key.startswith(prefix):
                        break
                    out.append(bytes(key[len(prefix) :]))
        return out

    def num_blocks(self) -> int:
        with self.env.begin() as txn:
            return int(txn.stat(self._blocks)["entries"])

    # writes

    def new_segment(self, at_least: int) -> int:
        """Register a new, empty segment (before its file is created, so it is never orphaned).
        Ids only grow (never reused, even after every segment was reclaimed), and are at least
        `at_least` (the caller passes one more than the largest id it saw on disk)."""
        with self.env.begin(write=True) as txn:
            raw = txn.get(_NEXT_SEGMENT, db=self._meta)
            segment = max(at_least, 1 if raw is None else segment_of_key(raw))
            txn.put(_NEXT_SEGMENT, segment_key(segment + 1), db=self._meta)
            txn.put(segment_key(segment), encode(SegmentInfo(0, 0, 0)), db=self._segments)
        return segment

    def put_many(
        self, entries: Iterable[tuple[BlockHash, BlockRecord]], segment: int, size_bytes: int
    ) -> None:
        """Commit records (their bytes already durable) and the active segment's new size."""
        with self.env.begin(write=True) as txn:
            for block_hash, record in entries:
                old = txn.get(block_hash, db=self._blocks)
                if old is not None:
                    self._delete(txn, block_hash, decode_record(old))
                self._insert(txn, block_hash, record)
            info = self._segment(txn, segment)
            self._put_segment(txn, segment, SegmentInfo(size_bytes, info.live_bytes, info.num_live))

    def touch_many(
        self, hashes: Iterable[BlockHash], now_s: float, ttl_s: float, retention: str
    ) -> int:
        """A hit: last access = now, expiry = max(old, now + ttl). Returns entries updated."""
        n = 0
        with self.env.begin(write=True) as txn:
            for block_hash in hashes:
                raw = txn.get(block_hash, db=self._blocks)
                if raw is None:
                    continue
                old = decode_record(raw)
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
        return n

    def remove_many(self, hashes: Iterable[BlockHash]) -> list[BlockRecord]:
        """Drop entries (absent ones are skipped); returns the records removed."""
        removed = []
        with self.env.begin(write=True) as txn:
            for block_hash in hashes:
                raw = txn.get(block_hash, db=self._blocks)
                if raw is not None:
                    record = decode_record(raw)
                    self._delete(txn, block_hash, record)
                    removed.append(record)
        return removed

    def remove_segment(self, segment: int) -> None:
        """Forget a segment whose entries are all gone (its file is deleted next)."""
        with self.env.begin(write=True, db=self._segments) as txn:
            raw = txn.get(segment_key(segment))
            assert raw is None or decode_segment(raw).num_live == 0, "segment still has entries"
            txn.delete(segment_key(segment))

    def _insert(self, txn: lmdb.Transaction, block_hash: BlockHash, record: BlockRecord) -> None:
        txn.put(block_hash, encode(record), db=self._blocks)
        txn.put(time_key(record.last_access_s, block_hash), b"", db=self._lru)
        txn.put(time_key(record.expires_s, block_hash), b"", db=self._expiry)
        txn.put(segment_key(record.segment) + block_hash, b"", db=self._by_seg)
        info = self._segment(txn, record.segment)
        live = info.live_bytes + record_bytes(record.length)
        self._put_segment(
            txn, record.segment, SegmentInfo(info.size_bytes, live, info.num_live + 1)
        )

    def _delete(self, txn: lmdb.Transaction, block_hash: BlockHash, record: BlockRecord) -> None:
        txn.delete(block_hash, db=self._blocks)
        txn.delete(time_key(record.last_access_s, block_hash), db=self._lru)
        txn.delete(time_key(record.expires_s, block_hash), db=self._expiry)
        txn.delete(segment_key(record.segment) + block_hash, db=self._by_seg)
        info = self._segment(txn, record.segment)
        live = info.live_bytes - record_bytes(record.length)
        self._put_segment(
            txn, record.segment, SegmentInfo(info.size_bytes, live, info.num_live - 1)
        )

    def _segment(self, txn: lmdb.Transaction, segment: int) -> SegmentInfo:
        raw = txn.get(segment_key(segment), db=self._segments)
        return SegmentInfo(0, 0, 0) if raw is None else decode_segment(raw)

    def _put_segment(self, txn: lmdb.Transaction, segment: int, info: SegmentInfo) -> None:
        txn.put(segment_key(segment), encode(info), db=self._segments)

    def check_integrity(self) -> None:
        """The tables mirror each other and the segment accounting adds up (O(entries))."""
        live: dict[int, list[int]] = {}
        with self.env.begin() as txn:
            for key, raw in txn.cursor(db=self._blocks).iternext():
                r = decode_record(raw)
                for db, k in (
                    (self._lru, time_key(r.last_access_s, key)),
                    (self._expiry, time_key(r.expires_s, key)),
                    (self._by_seg, segment_key(r.segment) + key),
                ):
                    require(txn.get(k, db=db) is not None, f"entry {key.hex()[:12]} lacks {db}")
                acc = live.setdefault(r.segment, [0, 0])
                acc[0], acc[1] = acc[0] + record_bytes(r.length), acc[1] + 1
            n = int(txn.stat(self._blocks)["entries"])
            for db in (self._lru, self._expiry, self._by_seg):
                require(int(txn.stat(db)["entries"]) == n, "index tables differ in size")
            for k, v in txn.cursor(db=self._segments).iternext():
                info, acc = decode_segment(v), live.pop(segment_of_key(k), [0, 0])
                require(
                    (info.live_bytes, info.num_live) == tuple(acc),
                    f"segment {segment_of_key(k)} accounting {info} != {acc}",
                )
        require(not live, f"entries point at unregistered segments {sorted(live)}")


def _replace(record: BlockRecord, **changes: object) -> BlockRecord:
    return msgspec.structs.replace(record, **changes)
