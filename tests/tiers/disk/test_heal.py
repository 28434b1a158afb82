"""The disk tier heals instead of failing: damaged index records and segment bytes are misses
(dropped, counted, stored again on the next offer), an index LMDB cannot open is moved aside and
rebuilt empty, a tier that could not open comes back once its directory is usable (with backoff,
on an injected clock), and no exception of any kind leaves a tier call."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import lmdb
import pytest

from deepinfer.tiers.disk.config import fingerprint_dir
from deepinfer.tiers.disk.guard import Backoff
from deepinfer.tiers.disk.index import BlockIndex
from deepinfer.tiers.disk.records import segment_key
from deepinfer.tiers.disk.segments import HEADER
from deepinfer.tiers.disk.store import DiskStore
from tests.tiers.disk.disk_helpers import (
    FP,
    GARBAGE,
    Clock,
    damage_closed_index,
    h,
    make_tier,
    msgpack,
    payload,
    put_raw,
    store_of,
    wait_until,
    write,
)

BAD_VALUES = {
    "not msgpack": GARBAGE,
    "truncated": msgpack([1, 0, 2048, b"\0" * 16])[:-3],
    "wrong shape": msgpack(["a", "b"]),
    "negative offset": msgpack([1, -5, 2048, b"\0" * 16, 16, 0.0, 0.0, "chat", 1e12]),
    "short checksum": msgpack([1, 0, 2048, b"\0" * 3, 16, 0.0, 0.0, "chat", 1e12]),
    "segment beyond u32": msgpack([1 << 40, 0, 2048, b"\0" * 16, 16, 0.0, 0.0, "chat", 1e12]),
}


@pytest.mark.parametrize("value", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_damaged_record_is_a_miss_and_is_stored_again(tmp_path: Path, value: bytes) -> None:
    tier = make_tier(tmp_path)
    write(tier, range(4))
    tier.close()
    damage_closed_index(tmp_path, b"blocks", h(1), value)

    tier = make_tier(tmp_path)
    try:
        hashes = [h(i) for i in range(4)]
        assert tier.load(hashes) == [payload(0), None, payload(2), payload(3)]
        assert tier.flush(10)
        s = tier.stats()
        assert (s.num_corrupt_records, s.num_checksum_failures) == (1, 0)
        assert not s.degraded and s.num_io_errors == 0
        assert tier.contains_prefix([h(1)]) == 0, "the damaged entry was not dropped"
        tier.check_integrity()
        write(tier, [1])
        assert tier.load(hashes) == [payload(i) for i in range(4)]
        tier.check_integrity()
        assert tier.verify_all() == 0
    finally:
        tier.close()


def test_damaged_record_while_open_never_escapes(tmp_path: Path) -> None:
    """Damage met by every path (touch, offer of the same block, load, sweep) while serving."""
    tier = make_tier(tmp_path)
    try:
        write(tier, range(6))
        index = store_of(tier).index
        for i in (1, 2, 3):
            put_raw(index.env, index.blocks, h(i), GARBAGE)
        tier.touch([h(1)])
        assert tier.offer(h(2), payload(2), 16)
        assert tier.flush(10)
        assert tier.contains_prefix([h(0)]) == 1
        got = tier.load([h(i) for i in range(6)])
        assert got == [payload(0), None, payload(2), None, payload(4), payload(5)]
        assert tier.sweep() is not None
        assert tier.flush(10)
        tier.check_integrity()
        s = tier.stats()
        assert s.num_corrupt_records == 3 and not s.degraded and s.num_index_repairs >= 1
    finally:
        tier.close()


def test_impossible_location_is_a_checksum_miss(tmp_path: Path) -> None:
    """A record that decodes but points far past the file's end: no allocation, a miss."""
    tier = make_tier(tmp_path)
    try:
        write(tier, range(2))
        index = store_of(tier).index
        huge = msgpack([1, 10**12, 10**12, b"\0" * 16, 16, 0.0, 0.0, "chat", 1e12])
        put_raw(index.env, index.blocks, h(1), huge)
        assert tier.load([h(0), h(1)]) == [payload(0), None]
        s = tier.stats()
        assert (s.num_checksum_failures, s.num_corrupt_records, s.num_io_errors) == (1, 0, 0)
        assert tier.flush(10)
        tier.check_integrity()
    finally:
        tier.close()


def test_damaged_segment_bytes_are_misses(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    write(tier, range(4))
    store = store_of(tier)
    record = store.index.get_many([h(2)])[0]
    assert record is not None
    path = store.segments.path(record.segment)
    tier.close()
    with path.open("r+b") as f:  # the header's magic, then a payload byte
        f.seek(record.offset)
        f.write(b"XXXX")
        f.seek(record.offset + HEADER.size + 7)
        f.write(b"\xff")

    tier = make_tier(tmp_path)
    try:
        assert tier.load([h(i) for i in range(4)]) == [payload(0), payload(1), None, payload(3)]
        s = tier.stats()
        assert (s.num_checksum_failures, s.num_corrupt_records) == (1, 0)
        write(tier, [2])
        assert tier.load([h(2)]) == [payload(2)]
        tier.check_integrity()
    finally:
        tier.close()


def test_damaged_segment_entry_is_rebuilt(tmp_path: Path) -> None:
    """A `segments` entry that fails to decode: stats and sweeps go on, the writer rebuilds the
    accounting from the block records, and no file the blocks still use is deleted."""
    tier = make_tier(tmp_path)
    write(tier, range(4))
    record = store_of(tier).index.get_many([h(0)])[0]
    assert record is not None
    tier.close()
    damage_closed_index(tmp_path, b"segments", segment_key(record.segment), GARBAGE)

    tier = make_tier(tmp_path)
    try:
        tier.stats()
        tier.sweep()
        assert tier.flush(10)
        tier.check_integrity()
        assert tier.load([h(i) for i in range(4)]) == [payload(i) for i in range(4)]
        s = tier.stats()
        assert s.num_index_repairs >= 1 and not s.degraded and s.num_io_errors == 0
    finally:
        tier.close()


def test_unopenable_index_is_moved_aside_and_rebuilt(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    write(tier, range(8))
    tier.close()
    (data,) = tmp_path.glob("*/index/data.mdb")
    data.write_bytes(b"garbage " * 4096)

    tier = make_tier(tmp_path)
    try:
        s = tier.stats()
        assert not s.degraded and s.num_index_repairs == 1 and s.num_blocks == 0
        (aside,) = tmp_path.glob("*/index.broken-*")
        assert (aside / "data.mdb").read_bytes() == b"garbage " * 4096, "not kept as it was"
        assert list(tmp_path.glob("*/segments/*.seg")) == [], "unindexed segments leaked"
        assert tier.load([h(0)]) == [None]
        write(tier, range(3))
        assert tier.load([h(i) for i in range(3)]) == [payload(i) for i in range(3)]
        tier.check_integrity()
    finally:
        tier.close()


def test_index_failing_at_run_time_is_reset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LMDB reports damage while serving: a miss, and the writer moves the index aside and starts
    an empty one at once (one repair), which then takes writes."""
    tier = make_tier(tmp_path)
    try:
        write(tier, range(3))

        def damaged(self: object, *args: object) -> object:
            raise lmdb.CorruptedError("MDB_CORRUPTED: Located page was wrong type")

        monkeypatch.setattr(BlockIndex, "read_many", damaged)
        assert tier.load([h(0)]) == [None]
        wait_until(lambda: bool(list(tmp_path.glob("*/index.broken-*"))))
        monkeypatch.undo()
        wait_until(lambda: not tier.stats().degraded)
        assert tier.flush(10)
        s = tier.stats()
        assert not s.degraded and s.num_index_repairs == 1 and s.num_blocks == 0
        assert tier.load([h(0)]) == [None]
        write(tier, [5])
        assert tier.load([h(5)]) == [payload(5)]
        tier.check_integrity()
    finally:
        tier.close()


@pytest.mark.parametrize("blocked", ["segments", "index", "root"])
def test_blocked_directory_degrades_then_recovers_with_backoff(
    tmp_path: Path, blocked: str
) -> None:
    """A file where a folder should be (root ignores chmod, so a file is how open fails here):
    degraded, retried after 1 s, then 2 s, ...; healthy once the file is gone."""
    root = tmp_path / "cache"
    target = root if blocked == "root" else fingerprint_dir(root, FP) / blocked
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("not a directory")
    mono = Clock(1000.0)
    tier = make_tier(root, mono)
    try:
        assert tier.stats().degraded and tier.stats().num_io_errors == 1
        assert not tier.offer(h(0), payload(0), 16)
        assert tier.load([h(0)]) == [None] and tier.contains_prefix([h(0)]) == 0
        mono.now_s += 1.0  # first retry: still blocked, next wait 2 s
        wait_until(lambda: tier.stats().num_io_errors == 2)
        mono.now_s += 1.0
        time.sleep(0.4)
        assert tier.stats().num_io_errors == 2, "retried before its time"
        target.unlink()
        mono.now_s += 1.0
        wait_until(lambda: not tier.stats().degraded)
        write(tier, [0])
        assert tier.load([h(0)]) == [payload(0)]
        tier.check_integrity()
    finally:
        tier.close()


def test_unexpected_errors_degrade_and_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any exception type inside the tier (here a ValueError on reads, a struct.error in the
    writer) is a miss or a dropped write, never raised; the writer survives and recovers."""
    mono = Clock(1000.0)
    tier = make_tier(tmp_path, mono)
    try:
        write(tier, range(2))

        def broken(self: object, *args: object) -> object:
            raise ValueError("unexpected")

        def broken_write(self: object, *args: object) -> object:
            raise struct.error("unexpected")

        monkeypatch.setattr(BlockIndex, "contains_prefix", broken)
        monkeypatch.setattr(DiskStore, "write", broken_write)
        assert tier.contains_prefix([h(0)]) == 0
        assert tier.stats().degraded
        mono.now_s += 1.0  # the writer reopens the store, then takes offers again
        wait_until(lambda: tier.offer(h(7), payload(7), 16))
        assert tier.flush(5), "the writer thread died"
        s = tier.stats()
        assert s.degraded and s.num_io_errors == 2 and s.num_writes == 2
        monkeypatch.undo()
        mono.now_s += 60.0
        wait_until(lambda: not tier.stats().degraded)
        write(tier, [3])
        assert tier.contains_prefix([h(0), h(1)]) == 2
        assert tier.load([h(3)]) == [payload(3)]
        tier.check_integrity()
    finally:
        tier.close()


def test_lost_entries_let_their_segments_be_reclaimed(tmp_path: Path) -> None:
    """Entries dropped as damaged leave their segment with no live bytes: the next sweep deletes
    the file, so lost entries never leak disk."""
    tier = make_tier(tmp_path)
    try:
        write(tier, range(24))  # ~50 KiB: three closed segments of 16 KiB
        store = store_of(tier)
        first = min(store.index.segments())
        doomed = store.index.hashes_in(first)
        for block_hash in doomed:
            put_raw(store.index.env, store.index.blocks, block_hash, GARBAGE)
        assert tier.repair() == 0
        assert tier.stats().num_corrupt_records == len(doomed)
        tier.sweep()
        tier.check_integrity()
        assert not store.segments.path(first).exists()
        assert first not in store.index.segments()
        alive = [i for i in range(24) if h(i) not in doomed]
        assert tier.load([h(i) for i in alive]) == [payload(i) for i in alive]
    finally:
        tier.close()


def test_backoff_doubles_to_its_bound_and_resets() -> None:
    clock = Clock(0.0)
    backoff = Backoff(1.0, 60.0, clock)
    waits = []
    for _ in range(9):
        waits.append(backoff.fail())
        assert backoff.waiting()
        clock.now_s += waits[-1]
        assert not backoff.waiting()
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    assert backoff.fail() == 60.0 and backoff.fail() == 60.0  # failures while waiting: same wait
    assert backoff.succeed() and not backoff.waiting() and backoff.fail() == 1.0
