"""kill -9 during heavy writes, and restarts: a second process sees exactly what the first made
durable, the index stays consistent, and no corrupt block is ever returned."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer.tiers.disk import DiskTier
from tests.tiers.disk.disk_writer_script import FINGERPRINT, block_hash, crash_config, payload_for

SCRIPT = Path(__file__).with_name("disk_writer_script.py")
ROOT = Path(__file__).resolve().parents[3]


def _spawn(cache_dir: Path, mode: str, n: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(cache_dir), mode, str(n)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _indexed_blocks(tier: DiskTier, upto: int) -> list[int]:
    """Block numbers < upto that the index holds (via presence, one at a time)."""
    return [i for i in range(upto) if tier.contains_prefix([block_hash(i)]) == 1]


ROUND_BLOCKS = 10_000
"""Each round's writer starts at round * ROUND_BLOCKS, so its blocks are new."""


@pytest.mark.slow  # runs long
def test_kill_9_during_writes_never_corrupts(tmp_path: Path) -> None:
    rng = random.Random(1234)
    num_new = 0
    for round_ in range(20):
        start = round_ * ROUND_BLOCKS
        proc = _spawn(tmp_path, "forever", start)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()

        tier = DiskTier(FINGERPRINT, crash_config(tmp_path))
        tier.open()
        assert not tier.stats().readonly and not tier.stats().degraded
        tier.check_integrity()
        assert tier.verify_all() == 0, "an index entry points at bytes that do not verify"
        present = _indexed_blocks(tier, start + ROUND_BLOCKS)
        assert present, "nothing survived: the test is not exercising recovery"
        num_new += sum(i >= start for i in present)
        # The reopened tier's own sweeper may evict between the scan and the load (a miss is
        # fine); a block returned must be exactly the one written.
        payloads = tier.load([block_hash(i) for i in present])
        wrong = [
            i for i, p in zip(present, payloads, strict=True) if p not in (None, payload_for(i))
        ]
        assert wrong == [] and any(p is not None for p in payloads)
        stats = tier.stats()
        assert stats.num_checksum_failures == 0
        assert stats.disk_bytes <= crash_config(tmp_path).max_bytes + (256 << 10)
        tier.close()
    assert num_new > 200, "the writers barely wrote: kill timing is not testing heavy writes"


def test_restart_second_process_reads_first_ones_blocks(tmp_path: Path) -> None:
    writer = _spawn(tmp_path, "once", 60)
    out, _ = writer.communicate(timeout=60)
    assert out.strip() == "done"
    tier = DiskTier(FINGERPRINT, crash_config(tmp_path))
    tier.open()
    try:
        got = tier.load([block_hash(i) for i in range(60)])
        assert got == [payload_for(i) for i in range(60)]
        # While this process holds the writer lock, another one opens read-only and still hits.
        reader = _spawn(tmp_path, "read", 60)
        out, _ = reader.communicate(timeout=60)
        assert out.strip() == "hits=60 ok=60 readonly=True"
    finally:
        tier.close()
