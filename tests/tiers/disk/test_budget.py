"""A full filesystem: the tier lowers its byte budget below what it holds, evicts down to it and
goes on caching, leaving headroom to other writers; the budget returns to `max_bytes` when space
does. Once on a simulated small filesystem (ENOSPC raised at the segment write seam, always run),
once on a real tmpfs of 1 MiB (root only; skipped where mounting is not permitted)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from deepinfer.cache.free_queue import IntegrityError
from deepinfer.tiers.disk import DiskTier, budget, segments, tier
from deepinfer.tiers.disk.budget import ByteBudget, is_no_space
from tests.tiers.disk.disk_helpers import Clock, h, make_tier, payload

KIB = 1 << 10
MIB = 1 << 20


def test_budget_lowers_below_what_is_held_and_follows_space_back() -> None:
    budget = ByteBudget(max_bytes=MIB, segment_bytes=16 * KIB)
    assert budget.bytes == MIB and not budget.lowered
    assert budget.follow(100 * KIB, 0) == MIB, "not lowered: free space is not looked at"
    assert budget.lower(160 * KIB, 0) == 140 * KIB  # an eighth of 160 KiB held
    assert budget.lowered
    budget.check_integrity()
    assert budget.follow(140 * KIB, 20 * KIB) == 140 * KIB, "evicting to the budget moves nothing"
    assert budget.follow(140 * KIB, 4 * KIB) == 126 * KIB, "another writer took space"
    assert budget.lower(40 * KIB, 0) == 32 * KIB, "never below two segments"
    assert budget.lower(8 * KIB, 0) == 32 * KIB
    assert budget.follow(32 * KIB, 8 * MIB) == MIB and not budget.lowered
    budget.check_integrity()


def test_budget_integrity_check_catches_a_bad_value() -> None:
    budget = ByteBudget(max_bytes=MIB, segment_bytes=16 * KIB)
    budget._bytes = 0
    with pytest.raises(IntegrityError):
        budget.check_integrity()


def test_no_space_errors_are_recognised() -> None:
    assert is_no_space(OSError(errno.ENOSPC, "No space left on device"))
    assert is_no_space(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_no_space(lmdb.DiskError("mdb_txn_commit", errno.ENOSPC))
    assert not is_no_space(OSError(errno.EIO, "Input/output error"))
    assert not is_no_space(ValueError("no"))


@pytest.mark.parametrize(("free", "full"), [(4 * KIB, True), (64 * MIB, False)])
def test_io_error_counts_as_no_space_only_on_a_nearly_full_filesystem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free: int, full: bool
) -> None:
    """LMDB reports a page write cut short by a full filesystem as EIO."""
    monkeypatch.setattr(budget, "free_bytes", lambda directory: free)
    assert is_no_space(lmdb.Error("mdb_txn_commit", errno.EIO), tmp_path) is full
    assert is_no_space(OSError(errno.EIO, "Input/output error"), tmp_path) is full
    assert not is_no_space(lmdb.Error("mdb_txn_commit", errno.EIO))


class SmallDisk:
    """A filesystem of `capacity_bytes` as far as segment files go: a write that would take the
    files past it fails with ENOSPC, and free space is what the files leave."""

    def __init__(self, root: Path, capacity_bytes: int) -> None:
        self.root, self.capacity_bytes = root, capacity_bytes
        self._write = segments._pwrite_all
        self.num_refused = 0

    def used(self) -> int:
        return sum(p.stat().st_size for p in self.root.glob("*/segments/*.seg"))

    def free(self, directory: Path) -> int:
        del directory
        return max(0, self.capacity_bytes - self.used())

    def pwrite_all(self, fd: int, data: bytes, offset: int) -> None:
        growth = max(0, offset + len(data) - os.fstat(fd).st_size)
        if self.used() + growth > self.capacity_bytes:
            self.num_refused += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._write(fd, data, offset)


def _write_in_batches(t: DiskTier, ids: range, size: int = 2048) -> None:
    """Batches of 16 blocks, a second apart (so least recently used means written earliest)."""
    clock = t.clock
    assert isinstance(clock, Clock)
    for start in range(ids.start, ids.stop, 16):
        clock.now_s += 1.0
        for i in range(start, min(start + 16, ids.stop)):
            assert t.offer(h(i), payload(i, size), 16), f"block {i} was refused"
        assert t.flush(10)
        t.check_integrity()


def _assert_recent_served(t: DiskTier, ids: range, size: int = 2048) -> None:
    assert t.load([h(i) for i in ids]) == [payload(i, size) for i in ids]


def test_full_disk_lowers_budget_evicts_and_keeps_caching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = SmallDisk(tmp_path, 160 * KIB)
    monkeypatch.setattr(segments, "_pwrite_all", disk.pwrite_all)
    monkeypatch.setattr(tier, "free_bytes", disk.free)
    t = make_tier(tmp_path, max_bytes=MIB, segment_bytes=16 * KIB)
    try:
        _write_in_batches(t, range(200))  # about 420 KiB into 160 KiB
        s = t.stats()
        assert disk.num_refused >= 1 and s.num_no_space >= 1
        assert s.budget_bytes < 160 * KIB and s.num_evictions > 0
        assert not s.degraded and s.num_writes_dropped == 0 and s.num_io_errors == 0
        assert disk.used() <= s.budget_bytes + 4 * KIB
        assert disk.free(tmp_path) >= 16 * KIB, "no headroom left to other writers"
        _assert_recent_served(t, range(180, 200))
        assert t.verify_all() == 0

        disk.capacity_bytes = 64 * MIB  # space comes back
        t.sweep()
        assert t.stats().budget_bytes == MIB
        refused = disk.num_refused
        _write_in_batches(t, range(200, 400))
        s = t.stats()
        assert disk.num_refused == refused and s.disk_bytes > 400 * KIB
        _assert_recent_served(t, range(200, 400))
        t.check_integrity()
    finally:
        t.close()


def test_full_disk_during_compaction_drops_the_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment to compact whose live blocks find no room: dropped with them, which frees it."""
    t = make_tier(tmp_path, max_bytes=MIB, segment_bytes=16 * KIB)
    try:
        _write_in_batches(t, range(40))
        store = t._store
        assert store is not None
        first = min(store.index.segments())
        hashes = store.index.hashes_in(first)
        store.index.remove_many(hashes[: len(hashes) * 2 // 3])  # below the live fraction

        def full(fd: int, data: bytes, offset: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(segments, "_pwrite_all", full)
        result = t.sweep()
        assert result is not None and result.num_segments_reclaimed >= 1
        assert not store.segments.path(first).exists()
        assert t.contains_prefix([hashes[-1]]) == 0
        t.check_integrity()
    finally:
        t.close()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (needs root and a kernel that lets this process mount)."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_full_tmpfs_lowers_budget_and_recovers(tmpfs: Path) -> None:
    size = 8 * KIB
    t = make_tier(tmpfs, max_bytes=4 * MIB, segment_bytes=64 * KIB)
    try:
        _write_in_batches(t, range(300), size)  # about 2.4 MiB into 1 MiB
        s = t.stats()
        assert s.num_no_space >= 1 and s.budget_bytes < MIB and s.num_evictions > 0
        assert not s.degraded and s.num_writes_dropped == 0
        _assert_recent_served(t, range(290, 300), size)
        assert t.verify_all() == 0
        other = tmpfs / "another-writer"
        other.write_bytes(b"x" * (64 * KIB))  # the headroom is there for others
        other.unlink()

        done = subprocess.run(["mount", "-o", "remount,size=16m", str(tmpfs)], check=False)
        if done.returncode == 0:  # space comes back
            t.sweep()
            assert t.stats().budget_bytes == 4 * MIB
            _write_in_batches(t, range(300, 600), size)
            s = t.stats()
            assert s.disk_bytes > 2 * MIB and not s.degraded
            _assert_recent_served(t, range(300, 600), size)
        t.check_integrity()
    finally:
        t.close()
