"""A process for the mapped-index tests (run as a script, not collected): it damages a file LMDB
maps under a disk tier, uses the tier, and prints "ok" once the damage is healed. A SIGBUS ends
it with a signal instead, which the test reports.

    python index_damage_script.py CACHE_DIR SCENARIO     (SCENARIO: a key of `DAMAGES`)
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from disk_helpers import Clock, h, make_tier, payload, wait_until, write

from deepinfer.tiers.disk import DiskTier

NUM_BLOCKS = 300
"""Enough entries that `data.mdb` spans many pages beyond its two meta pages."""
META_BYTES = 8192
"""LMDB's two meta pages (4 KiB pages): a file cut to this still opens, its tree gone."""


def index_file(root: Path, name: str) -> Path:
    (path,) = root.glob(f"*/index/{name}")
    return path


def replace_data(root: Path) -> None:
    """A copy renamed over `data.mdb`: the tier's mapping still shows the old file."""
    path = index_file(root, "data.mdb")
    copy = path.with_name("data.mdb.copy")
    shutil.copyfile(path, copy)
    os.replace(copy, path)


DAMAGES: dict[str, Callable[[Path], None]] = {
    "data-cut-to-meta": lambda root: os.truncate(index_file(root, "data.mdb"), META_BYTES),
    "data-emptied": lambda root: os.truncate(index_file(root, "data.mdb"), 0),
    "lock-emptied": lambda root: os.truncate(index_file(root, "lock.mdb"), 0),
    "data-replaced": replace_data,
}


def damaged_while_running(root: Path, scenario: str) -> None:
    mono = Clock(1000.0)
    tier = make_tier(root, mono)
    try:
        write(tier, range(NUM_BLOCKS))
        DAMAGES[scenario](root)
        hashes = [h(i) for i in range(0, NUM_BLOCKS, 7)]
        assert tier.contains_prefix(hashes) == 0
        assert tier.load(hashes) == [None] * len(hashes)
        assert asyncio.run(tier.load_async(hashes)) == [None] * len(hashes)
        tier.stats()
        tier.summary()
        healed_and_serving(root, tier, mono)
    finally:
        tier.close()


def damaged_while_closed(root: Path) -> None:
    """`data.mdb` cut to its meta pages between two runs: the commit they name lies beyond."""
    tier = make_tier(root)
    write(tier, range(NUM_BLOCKS))
    tier.close()
    os.truncate(index_file(root, "data.mdb"), META_BYTES)
    mono = Clock(1000.0)
    tier = make_tier(root, mono)
    try:
        assert tier.load([h(0)]) == [None]
        healed_and_serving(root, tier, mono)
    finally:
        tier.close()


def healed_and_serving(root: Path, tier: DiskTier, mono: Clock) -> None:
    """The damaged index was moved aside; once the retry is due the tier serves new writes."""
    wait_until(lambda: bool(list(root.glob("*/index.broken-*"))), 10.0)
    mono.now_s += 120.0
    wait_until(lambda: not tier.stats().degraded, 10.0)
    assert tier.flush(10)
    s = tier.stats()
    assert s.num_index_repairs >= 1 and s.num_blocks == 0, s
    assert tier.load([h(1)]) == [None]
    write(tier, [NUM_BLOCKS])
    assert tier.load([h(NUM_BLOCKS)]) == [payload(NUM_BLOCKS)]
    tier.check_integrity()
    assert tier.verify_all() == 0


def main() -> None:
    root, scenario = Path(sys.argv[1]), sys.argv[2]
    if scenario == "data-cut-while-closed":
        damaged_while_closed(root)
    else:
        damaged_while_running(root, scenario)
    print("ok", flush=True)


if __name__ == "__main__":
    main()
