"""`DiskTier.load_async`: the event loop's read path (aiofiles) gives what `load` gives, damage
included: the same payloads, the same entries dropped, the same counters; segment files are read
through aiofiles, once per segment, and the LMDB and checksum work runs off the loop's thread."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from deepinfer.tiers.disk import DiskTier, async_reads
from deepinfer.tiers.disk.records import BlockRecord
from deepinfer.tiers.disk.segments import HEADER, SegmentStore
from deepinfer.tiers.disk.store import DiskStore
from tests.tiers.disk.disk_helpers import h, make_tier, msgpack, payload, put_raw, store_of, write

NUM_BLOCKS = 24
"""2 KiB payloads in 16 KiB segments: several segments, several records each."""


def _record(tier: DiskTier, i: int) -> BlockRecord:
    record = store_of(tier).index.get_many([h(i)])[0]
    assert record is not None
    return record


def _damage(tier: DiskTier) -> set[int]:
    """Five kinds of damage to a tier, which is then closed. Returns the blocks damaged."""
    store = store_of(tier)
    records = {i: _record(tier, i) for i in range(NUM_BLOCKS)}
    flipped, magic, torn, far = records[1], records[5], records[14], records[11]
    lost = records[20].segment
    assert len({flipped.segment, torn.segment, lost}) == 3, "the layout these tests assume"
    index = store.index
    far_away = msgpack([far.segment, 10**12, 10**12, far.checksum, 16, 0.0, 0.0, "chat", 1e12])
    put_raw(index.env, index.blocks, h(11), far_away)  # past the file's end: nothing allocated
    tier.close()
    with store.segments.path(flipped.segment).open("r+b") as f:  # one payload bit
        f.seek(flipped.offset + HEADER.size + flipped.length // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    with store.segments.path(magic.segment).open("r+b") as f:  # the header's magic
        f.seek(magic.offset)
        f.write(b"XXXX")
    with store.segments.path(torn.segment).open("r+b") as f:  # a torn tail
        f.truncate(torn.offset + HEADER.size + 100)
    store.segments.path(lost).unlink()  # a whole segment gone
    cut = {i for i, r in records.items() if r.segment == torn.segment and r.offset >= torn.offset}
    return {1, 5, 11} | cut | {i for i, r in records.items() if r.segment == lost}


def _outcome(tier: DiskTier, got: list[bytes | None]) -> tuple[Any, ...]:
    s = tier.stats()
    still = [store_of(tier).index.get_many([h(i)])[0] is not None for i in range(NUM_BLOCKS)]
    counts = (s.num_lookups, s.num_hits, s.num_checksum_failures, s.num_io_errors)
    return got, counts, still


async def test_same_as_load_on_damaged_segments(tmp_path: Path) -> None:
    tier = make_tier(tmp_path / "a")
    write(tier, range(NUM_BLOCKS))
    damaged = _damage(tier)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    order = [*range(NUM_BLOCKS - 1, -1, -2), *range(0, NUM_BLOCKS, 2), 99]  # any order, a miss
    outcomes = []
    for root, use_async in ((tmp_path / "a", False), (tmp_path / "b", True)):
        tier = make_tier(root)
        try:
            assert tier.flush(10)  # the index check after opening
            hashes = [h(i) for i in order]
            got = await tier.load_async(hashes) if use_async else tier.load(hashes)
            assert tier.flush(10)
            tier.check_integrity()
            outcomes.append(_outcome(tier, got))
        finally:
            tier.close()
    assert outcomes[0] == outcomes[1]
    got, (lookups, hits, failures, io_errors), still = outcomes[1]
    assert got == [None if i in damaged or i == 99 else payload(i) for i in order]
    assert (lookups, hits) == (len(order), NUM_BLOCKS - len(damaged))
    assert failures >= 4 and io_errors == 0  # a lost segment's entries may go at open
    assert still == [i not in damaged for i in range(NUM_BLOCKS)]


def test_runs_join_adjacent_records_up_to_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    def rec(offset: int, length: int) -> BlockRecord:
        return BlockRecord(1, offset, length, b"\0" * 16, 16, 0.0, 0.0, "chat", 1e12)

    step = HEADER.size + 100
    items = [(i, rec(i * step, 100)) for i in (3, 0, 1, 2)] + [(4, rec(5 * step, 100))]
    runs = async_reads._runs(items)
    assert [[i for i, _ in run] for run in runs] == [[0, 1, 2, 3], [4]]
    monkeypatch.setattr(async_reads, "MAX_RUN_BYTES", 2 * step)
    runs = async_reads._runs(items)
    assert [[i for i, _ in run] for run in runs] == [[0, 1], [2, 3], [4]]


async def test_reads_go_through_aiofiles_once_per_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(tmp_path)
    try:
        write(tier, range(NUM_BLOCKS))
        segments = {_record(tier, i).segment for i in range(NUM_BLOCKS)}
        opened: list[Path] = []
        real_open = async_reads.aiofiles.open

        def counting_open(path: Path, mode: str) -> Any:
            opened.append(path)
            return real_open(path, mode)

        def no_sync_read(*args: object) -> None:
            raise AssertionError("a segment was read synchronously")

        monkeypatch.setattr(async_reads.aiofiles, "open", counting_open)
        monkeypatch.setattr(SegmentStore, "read_raw", no_sync_read)
        got = await tier.load_async([h(i) for i in range(NUM_BLOCKS)])
        assert got == [payload(i) for i in range(NUM_BLOCKS)]
        assert sorted(opened) == sorted(store_of(tier).segments.path(s) for s in segments)
    finally:
        tier.close()


async def test_lookup_and_checks_run_off_the_loop_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(tmp_path)
    loop_thread = threading.get_ident()
    threads: dict[str, int] = {}
    for name in ("locate", "verify"):
        real = getattr(DiskStore, name)

        def spy(self: DiskStore, *args: Any, _name: str = name, _real: Any = real) -> Any:
            threads[_name] = threading.get_ident()
            return _real(self, *args)

        monkeypatch.setattr(DiskStore, name, spy)
    try:
        write(tier, range(3))
        assert await tier.load_async([h(0), h(1), h(5)]) == [payload(0), payload(1), None]
        assert set(threads) == {"locate", "verify"}
        assert loop_thread not in threads.values()
    finally:
        tier.close()


async def test_no_store_and_failures_are_misses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(tmp_path)
    try:
        write(tier, range(2))

        def broken(*args: object) -> None:
            raise OSError("EIO")

        monkeypatch.setattr(DiskStore, "locate", broken)
        assert await tier.load_async([h(0), h(1)]) == [None, None]
        assert tier.degraded
    finally:
        tier.close()
    assert await tier.load_async([h(0)]) == [None]  # closed: no store
