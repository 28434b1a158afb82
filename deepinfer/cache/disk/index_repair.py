"""Checking the disk index, and rebuilding it from `blocks`, the one table that says what is
stored: `lru`, `expiry`, `by_segment` and the segment accounting are all derived from it.

A rebuild is one write transaction over every entry (O(entries): about a second per few hundred
thousand blocks), run by the tier's writer after damage was noticed, never on a request's path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lmdb

from deepinfer.cache.disk.records import (
    MAX_SEGMENT_ID,
    NEXT_SEGMENT,
    SegmentInfo,
    encode,
    segment_key,
    time_key,
    try_decode_record,
    try_decode_segment,
    try_segment_of_key,
)
from deepinfer.cache.disk.segments import record_bytes
from deepinfer.cache.free_queue import require

if TYPE_CHECKING:
    from deepinfer.cache.disk.index import BlockIndex


def rebuild(index: BlockIndex) -> int:
    """Drop `blocks` entries that fail to decode and derive the other tables from the rest.
    Segment sizes are kept where they decode (`DiskStore.recover` corrects them from the files).
    Returns entries dropped."""
    with index.begin(write=True) as txn:
        sizes = _segment_sizes(index, txn)
        for db in (index.lru, index.expiry, index.by_segment, index.segments_db):
            txn.drop(db, delete=False)
        bad: list[bytes] = []
        live: dict[int, tuple[int, int]] = {}
        for key, raw in txn.cursor(db=index.blocks).iternext():
            record = try_decode_record(key, raw)
            if record is None:
                bad.append(bytes(key))
                continue
            index.put_derived(txn, key, record)
            num_bytes, num = live.get(record.segment, (0, 0))
            live[record.segment] = (num_bytes + record_bytes(record.length), num + 1)
        for key in bad:
            txn.delete(key, db=index.blocks)
        for segment in sizes.keys() | live.keys():
            num_bytes, num = live.get(segment, (0, 0))
            info = SegmentInfo(sizes.get(segment, 0), num_bytes, num)
            txn.put(segment_key(segment), encode(info), db=index.segments_db)
        _repair_next_segment(index, txn, max(sizes.keys() | live.keys(), default=0))
    return len(bad)


def _segment_sizes(index: BlockIndex, txn: lmdb.Transaction) -> dict[int, int]:
    sizes = {}
    for key, raw in txn.cursor(db=index.segments_db).iternext():
        decoded = try_decode_segment(key, raw)
        if decoded is not None:
            sizes[decoded[0]] = decoded[1].size_bytes
    return sizes


def _repair_next_segment(index: BlockIndex, txn: lmdb.Transaction, max_segment: int) -> None:
    """Segment ids only grow: the counter must exceed every id registered."""
    raw = txn.get(NEXT_SEGMENT, db=index.meta)
    stored = None if raw is None else try_segment_of_key(raw)
    if stored is None or stored <= max_segment:
        txn.put(NEXT_SEGMENT, segment_key(min(max_segment + 1, MAX_SEGMENT_ID)), db=index.meta)


def check_integrity(index: BlockIndex) -> None:
    """The tables mirror each other and the segment accounting adds up (O(entries))."""
    live: dict[int, list[int]] = {}
    with index.begin() as txn:
        for key, raw in txn.cursor(db=index.blocks).iternext():
            r = try_decode_record(key, raw)
            require(r is not None, f"entry {key.hex()[:12]} does not decode")
            assert r is not None
            for db, k in (
                (index.lru, time_key(r.last_access_s, key)),
                (index.expiry, time_key(r.expires_s, key)),
                (index.by_segment, segment_key(r.segment) + key),
            ):
                require(txn.get(k, db=db) is not None, f"entry {key.hex()[:12]} lacks {db}")
            acc = live.setdefault(r.segment, [0, 0])
            acc[0], acc[1] = acc[0] + record_bytes(r.length), acc[1] + 1
        n = int(txn.stat(index.blocks)["entries"])
        for db in (index.lru, index.expiry, index.by_segment):
            require(int(txn.stat(db)["entries"]) == n, "index tables differ in size")
        for k, v in txn.cursor(db=index.segments_db).iternext():
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
