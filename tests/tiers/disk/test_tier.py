"""DiskTier in one process: round trip, retention with an injected clock, the byte budget,
corruption detection, back-pressure, and degraded mode on I/O errors."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deepinfer.cache.block_hash import block_hashes_for, seed_bytes
from deepinfer.errors import InvalidRequestError
from deepinfer.tiers.disk import DiskTier, DiskTierConfig
from deepinfer.tiers.disk.config import DAY_S, fingerprint_dir
from deepinfer.tiers.disk.segments import HEADER, SegmentStore

FP = "test-model-fingerprint"


class Clock:
    def __init__(self, now_s: float = 1_700_000_000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def h(i: int) -> bytes:
    return hashlib.sha256(b"h%d" % i).digest()


def payload(i: int, n: int = 2048) -> bytes:
    return (hashlib.sha256(b"p%d" % i).digest() * (n // 32 + 1))[:n]


def cfg(tmp_path: Path, **kw: object) -> DiskTierConfig:
    base: dict[str, object] = dict(
        cache_dir=tmp_path, max_bytes=1 << 20, segment_bytes=16 << 10, sweep_interval_s=3600.0
    )
    base.update(kw)
    return DiskTierConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def tier(tmp_path: Path, clock: Clock) -> Iterator[DiskTier]:
    t = DiskTier(FP, cfg(tmp_path), clock=clock)
    t.open()
    yield t
    t.close()


def write(tier: DiskTier, ids: range | list[int], retention: str | None = None) -> None:
    for i in ids:
        assert tier.offer(h(i), payload(i), 16, retention)
    assert tier.flush(10)
    tier.check_integrity()


def test_round_trip_and_prefix(tier: DiskTier) -> None:
    hashes = block_hashes_for(list(range(64)), 16, seed_bytes(FP))
    for i, bh in enumerate(hashes[:3]):
        assert tier.offer(bh, payload(i), 16)
    assert tier.offer(hashes[0], payload(0), 16)  # a duplicate is indexed once
    assert tier.flush(10)
    tier.check_integrity()
    assert tier.contains_prefix(hashes) == 3
    assert tier.load(hashes) == [payload(0), payload(1), payload(2), None]
    s = tier.stats()
    assert (s.num_blocks, s.num_writes, s.num_hits, s.num_lookups) == (3, 3, 3, 4)
    assert s.live_bytes == 3 * (HEADER.size + 2048) == s.disk_bytes
    assert not s.degraded and not s.readonly
    assert tier.verify_all() == 0


def test_retention_none_and_unknown(tier: DiskTier) -> None:
    assert not tier.offer(h(0), payload(0), 16, "none")
    with pytest.raises(InvalidRequestError, match="retention"):
        tier.offer(h(0), payload(0), 16, "forever")
    assert tier.flush(10)
    assert tier.stats().num_blocks == 0 and tier.stats().num_writes_dropped == 0


def test_expiry_with_injected_clock(tier: DiskTier, clock: Clock) -> None:
    write(tier, [0, 1], "agent")  # 3 days
    write(tier, [2, 3], "chat")  # 7 days
    clock.now_s += 2 * DAY_S
    tier.touch([h(0)], "agent")  # agent block 0 now lives until day 5
    assert tier.flush(10)
    clock.now_s += 1.5 * DAY_S  # day 3.5
    result = tier.sweep()
    assert result is not None and result.num_expired == 1
    assert tier.load([h(i) for i in range(4)]) == [payload(0), None, payload(2), payload(3)]
    clock.now_s += 2 * DAY_S  # day 5.5: block 0 expired, chat blocks live until day 7
    tier.sweep()
    assert tier.load([h(i) for i in range(4)]) == [None, None, payload(2), payload(3)]
    clock.now_s += 2 * DAY_S  # day 7.5: everything expired, the segment's space reclaimed
    tier.sweep()
    tier.check_integrity()
    s = tier.stats()
    assert (s.num_blocks, s.num_expirations) == (0, 4)
    assert s.disk_bytes <= tier.config.segment_bytes  # at most the active segment remains


def test_byte_budget_evicts_least_recently_used(tmp_path: Path, clock: Clock) -> None:
    config = cfg(tmp_path, max_bytes=64 << 10, segment_bytes=16 << 10)
    t = DiskTier(FP, config, clock=clock)
    t.open()
    try:
        for i in range(60):  # ~125 KiB of blocks, written one second apart
            clock.now_s += 1
            write(t, [i])
            if i % 10 == 9:
                t.touch([h(0)])  # block 0 stays recently used
        t.sweep()
        t.check_integrity()
        s = t.stats()
        assert s.disk_bytes <= config.max_bytes and s.num_evictions > 0
        alive = [i for i in range(60) if t.contains_prefix([h(i)])]
        # LRU: the survivors are block 0, which kept being touched (compaction moved it out of
        # the oldest segment), and an unbroken run of the most recent writes.
        assert alive[0] == 0 and alive[1:] == list(range(alive[1], 60)) and alive[1] > 20
        assert t.load([h(i) for i in alive]) == [payload(i) for i in alive]
    finally:
        t.close()


def _record_location(tier: DiskTier, i: int) -> tuple[Path, int, int]:
    store = tier._store
    assert store is not None
    record = store.index.get_many([h(i)])[0]
    assert record is not None
    return store.segments.path(record.segment), record.offset, record.length


def test_corruption_is_detected_and_dropped(tmp_path: Path, clock: Clock) -> None:
    t = DiskTier(FP, cfg(tmp_path), clock=clock)
    t.open()
    write(t, range(6))
    flipped = _record_location(t, 1)
    torn = _record_location(t, 5)
    t.close()
    path, offset, length = flipped
    with path.open("r+b") as f:  # one bit of block 1's payload
        f.seek(offset + HEADER.size + length // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    path, offset, _ = torn
    with path.open("r+b") as f:  # a torn tail: block 5 cut in half
        f.truncate(offset + HEADER.size + 100)

    t = DiskTier(FP, cfg(tmp_path), clock=clock)
    t.open()
    try:
        assert t.verify_all() == 2
        got = t.load([h(i) for i in range(6)])
        assert got == [payload(0), None, payload(2), payload(3), payload(4), None]
        assert t.stats().num_checksum_failures == 2
        assert t.contains_prefix([h(i) for i in range(6)]) == 1  # entry 1 was dropped
        assert t.verify_all() == 0
        t.check_integrity()
    finally:
        t.close()


def test_full_queue_drops_writes_without_waiting(tmp_path: Path, clock: Clock) -> None:
    t = DiskTier(FP, cfg(tmp_path, max_pending_bytes=8 << 10), clock=clock)
    t.open()
    try:
        with t._write_lock:  # a stalled disk: the writer cannot make progress
            start = time.monotonic()
            accepted = [t.offer(h(i), payload(i), 16) for i in range(20)]
            assert time.monotonic() - start < 1.0
        assert 0 < sum(accepted) < 20
        assert t.flush(10)
        s = t.stats()
        assert s.num_writes_dropped == 20 - sum(accepted) and s.num_blocks == sum(accepted)
    finally:
        t.close()


def test_disk_full_degrades_and_recovers(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = DiskTier(FP, cfg(tmp_path, retry_degraded_s=0.2), clock=clock)
    t.open()
    try:
        write(t, range(3))
        real_append = SegmentStore.append
        calls = {"n": 0}

        def append_then_fail(self: SegmentStore, block_hash: bytes, data: bytes) -> object:
            calls["n"] += 1
            if calls["n"] % 2 == 0:  # the disk fills up in the middle of a batch
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_append(self, block_hash, data)

        monkeypatch.setattr(SegmentStore, "append", append_then_fail)
        for i in range(3, 10):
            t.offer(h(i), payload(i), 16)  # never raises
        assert t.flush(10)
        s = t.stats()
        assert s.degraded and s.num_io_errors >= 1 and s.num_writes_dropped >= 1
        assert not t.offer(h(50), payload(50), 16)  # degraded: dropped at once
        assert t.load([h(0), h(1), h(2)]) == [payload(0), payload(1), payload(2)]
        t.check_integrity()
        assert t.verify_all() == 0  # no partial record was indexed
        monkeypatch.setattr(SegmentStore, "append", real_append)
        time.sleep(0.25)
        write(t, [60])
        assert not t.stats().degraded and t.load([h(60)]) == [payload(60)]
    finally:
        t.close()


def test_unwritable_dir_serves_misses(tmp_path: Path, clock: Clock) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    t = DiskTier(FP, cfg(blocker / "cache"), clock=clock)
    t.open()
    try:
        assert not t.offer(h(0), payload(0), 16)
        assert t.contains_prefix([h(0)]) == 0 and t.load([h(0)]) == [None]
        s = t.stats()
        assert s.degraded and s.num_io_errors == 1 and s.num_writes_dropped == 1
    finally:
        t.close()


def test_each_fingerprint_has_its_own_directory(tmp_path: Path, clock: Clock) -> None:
    a = DiskTier("model-a", cfg(tmp_path), clock=clock)
    a.open()
    write(a, [0])
    a.close()
    b = DiskTier("model-b", cfg(tmp_path), clock=clock)
    b.open()
    try:
        assert b.directory != a.directory == fingerprint_dir(tmp_path, "model-a")
        assert b.load([h(0)]) == [None]
    finally:
        b.close()


async def test_used_from_an_event_loop(tier: DiskTier) -> None:
    """The engine's pattern: offer/touch on the loop (enqueue only), load in an executor."""
    loop = asyncio.get_running_loop()
    for i in range(3):
        assert tier.offer(h(i), payload(i), 16)
    assert await loop.run_in_executor(None, tier.flush, 10.0)
    assert tier.contains_prefix([h(0), h(1), h(2), h(3)]) == 3
    got = await loop.run_in_executor(None, tier.load, [h(0), h(1), h(3)])
    assert got == [payload(0), payload(1), None]
