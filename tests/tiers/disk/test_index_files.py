"""The files LMDB maps, truncated, emptied or replaced under a disk tier: the index is moved aside
and rebuilt (its hits lost), never a SIGBUS. Each scenario runs in a child process, so a fault
fails its test instead of ending the test run; the checks themselves run in this process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.tiers.disk.index import BlockIndex
from deepinfer.tiers.disk.index_files import IndexFileChangedError
from deepinfer.tiers.disk.records import BlockRecord

SCRIPT = Path(__file__).with_name("index_damage_script.py")
ROOT = Path(__file__).resolve().parents[3]
SCENARIOS = ["data-cut-to-meta", "data-emptied", "lock-emptied", "data-replaced"]


def _run_child(cache_dir: Path, scenario: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(cache_dir), scenario],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    rc = proc.returncode
    ended = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
    assert rc == 0, f"the tier's process ended with {ended}:\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip().endswith("ok"), proc.stdout


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_mapped_file_damaged_while_running_is_healed(tmp_path: Path, scenario: str) -> None:
    _run_child(tmp_path, scenario)


def test_data_file_cut_between_runs_is_healed(tmp_path: Path) -> None:
    _run_child(tmp_path, "data-cut-while-closed")


def _record(i: int) -> tuple[bytes, BlockRecord]:
    block_hash = i.to_bytes(32, "big")
    return block_hash, BlockRecord(1, i * 100, 64, b"\0" * 16, 16, 0.0, 0.0, "chat", 1e12)


def _filled_index(path: Path, num: int) -> BlockIndex:
    index = BlockIndex(path, 64 << 20)
    index.new_segment(1)
    for start in range(0, num, 100):
        index.put_many([_record(i) for i in range(start, start + 100)], 1, 1 << 20)
    return index


def test_growth_is_not_damage(tmp_path: Path) -> None:
    """LMDB grows `data.mdb` as it commits: every later transaction still checks out."""
    index = _filled_index(tmp_path / "index", 100)
    try:
        size = (tmp_path / "index" / "data.mdb").stat().st_size
        index.put_many([_record(i) for i in range(100, 3000)], 1, 1 << 20)
        assert (tmp_path / "index" / "data.mdb").stat().st_size > size
        index.files.check()
        assert index.num_blocks() == 3000
        index.check_integrity()
    finally:
        index.close()


@pytest.mark.parametrize("name", ["data.mdb", "lock.mdb"])
def test_truncation_is_refused_before_any_read(tmp_path: Path, name: str) -> None:
    """Checked in this process: after the cut nothing reads the mapping (a read would fault);
    closing stays safe, the lock file being extended back first."""
    index = _filled_index(tmp_path / "index", 500)
    path = tmp_path / "index" / name
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(IndexFileChangedError, match="truncated"):
        index.num_blocks()
    with pytest.raises(IndexFileChangedError, match="truncated"):
        index.put_many([_record(9999)], 1, 1 << 20)
    index.close()


@pytest.mark.parametrize("how", ["replaced", "removed"])
def test_replaced_or_removed_data_file_is_refused(tmp_path: Path, how: str) -> None:
    index = _filled_index(tmp_path / "index", 200)
    path = tmp_path / "index" / "data.mdb"
    try:
        if how == "replaced":
            shutil.copyfile(path, path.with_name("copy"))
            os.replace(path.with_name("copy"), path)
        else:
            path.unlink()
        with pytest.raises(IndexFileChangedError, match=how):
            index.get_many([_record(1)[0]])
    finally:
        index.close()


def test_cut_file_is_refused_at_open(tmp_path: Path) -> None:
    _filled_index(tmp_path / "index", 500).close()
    os.truncate(tmp_path / "index" / "data.mdb", 8192)
    with pytest.raises(IndexFileChangedError, match="truncated"):
        BlockIndex(tmp_path / "index", 64 << 20)
    with pytest.raises(IndexFileChangedError, match="truncated"):
        BlockIndex(tmp_path / "index", 64 << 20, readonly=True)
