"""Random damage to a disk tier in use (fixed seed): flipped, truncated and deleted segment files,
garbage and flipped index values, missing and stray index entries, records flipped inside
`data.mdb` between runs. No tier call ever raises, every payload served is the one written for its hash,
and after healing the index checks out and new writes are served again."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from deepinfer.tiers.disk import DiskTier
from tests.tiers.disk.disk_helpers import Clock, h, make_tier, store_of, wait_until

SEED = 20250611
NUM_TRIALS = 300
HEAL_EVERY = 25
TABLES = ("blocks", "lru", "expiry", "segments", "by_segment")


def payload(i: int) -> bytes:
    """512-2048 bytes that depend on i (sizes vary, so offsets do too)."""
    n = 512 * (1 + i % 4)
    seed = random.Random(i).randbytes(32)
    return (seed * (n // 32 + 1))[:n]


class Harness:
    """One tier under random damage; remembers what was written."""

    def __init__(self, root: Path, rng: random.Random) -> None:
        self.root, self.rng = root, rng
        self.mono = Clock(1000.0)
        self.tier = self._open()
        self.num_written = 0
        self.num_served = 0
        self.totals: Counter[str] = Counter()
        """Damage counters over every run of the tier."""

    def _open(self) -> DiskTier:
        return make_tier(self.root, self.mono, max_bytes=256 << 10, segment_bytes=32 << 10)

    def reopen(self) -> None:
        self.close()
        self.tier = self._open()

    def close(self) -> None:
        s = self.tier.stats()
        self.totals.update(
            corrupt=s.num_corrupt_records, checksum=s.num_checksum_failures,
            repairs=s.num_index_repairs,
        )  # fmt: skip
        self.tier.close()

    # use

    def write_some(self) -> None:
        for _ in range(self.rng.randint(1, 6)):
            i = self.num_written
            self.tier.offer(h(i), payload(i), 16, self.rng.choice(["chat", "agent"]))
            self.num_written += 1
        self.tier.flush(10)

    def use(self) -> None:
        """Every lookup path, on random known blocks; a payload served must be the right one."""
        ids = [self.rng.randrange(self.num_written) for _ in range(self.rng.randint(1, 12))]
        hashes = [h(i) for i in ids]
        assert 0 <= self.tier.contains_prefix(hashes) <= len(hashes)
        got = self.tier.load(hashes)
        wrong = [i for i, p in zip(ids, got, strict=True) if p is not None and p != payload(i)]
        assert wrong == [], f"wrong KV served for blocks {wrong}"
        self.num_served += sum(p is not None for p in got)
        self.tier.touch(hashes[: self.rng.randint(0, len(hashes))])
        if ids and self.rng.random() < 0.3:  # offer a block again: stored anew if it was lost
            self.tier.offer(h(ids[0]), payload(ids[0]), 16)
        if self.rng.random() < 0.2:
            self.tier.sweep()
        self.tier.stats()

    def heal_and_check(self) -> None:
        """Let retries run (the injected clock jumps past any wait), check everything, then write
        and read a new block."""
        self.mono.now_s += 120.0
        wait_until(lambda: not self.tier.stats().degraded, 5.0)
        self.tier.repair()
        self.tier.sweep()
        self.tier.check_integrity()
        assert self.tier.verify_all() == 0
        i = self.num_written
        assert self.tier.offer(h(i), payload(i), 16)
        self.num_written += 1
        assert self.tier.flush(10)
        assert self.tier.load([h(i)]) == [payload(i)], "a new write is not served after healing"

    # damage

    def _segment_files(self) -> list[Path]:
        return sorted(self.root.glob("*/segments/*.seg"))

    def flip_segment_bytes(self) -> None:
        files = [p for p in self._segment_files() if p.stat().st_size]
        if files:
            path = self.rng.choice(files)
            data = bytearray(path.read_bytes())
            for _ in range(self.rng.randint(1, 4)):
                data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
            path.write_bytes(bytes(data))

    def truncate_segment(self) -> None:
        if files := self._segment_files():
            path = self.rng.choice(files)
            with path.open("r+b") as f:
                f.truncate(self.rng.randrange(path.stat().st_size + 1))

    def delete_segment(self) -> None:
        if files := self._segment_files():
            self.rng.choice(files).unlink()

    def damage_index_value(self) -> None:
        """Garbage, or one flipped bit (which may still decode), in a random entry's value."""
        if self.tier._store is None:
            return
        index = store_of(self.tier).index
        db = getattr(index, {"segments": "segments_db"}.get(t := self.rng.choice(TABLES), t))
        with index.env.begin(write=True, db=db) as txn:
            keys = list(txn.cursor().iternext(keys=True, values=False))
            if not keys:
                return
            key = self.rng.choice(keys)
            value = bytearray(txn.get(key) or b"\0")
            if self.rng.random() < 0.5:
                value = bytearray(self.rng.randbytes(self.rng.randint(1, 40)))
            else:
                value[self.rng.randrange(len(value))] ^= 1 << self.rng.randrange(8)
            txn.put(key, bytes(value))

    def damage_index_entries(self) -> None:
        """Delete a random entry of a random table, or add a stray one."""
        if self.tier._store is None:
            return
        index = store_of(self.tier).index
        db = getattr(index, {"segments": "segments_db"}.get(t := self.rng.choice(TABLES), t))
        with index.env.begin(write=True, db=db) as txn:
            keys = list(txn.cursor().iternext(keys=True, values=False))
            if keys and self.rng.random() < 0.5:
                txn.delete(self.rng.choice(keys))
            else:
                txn.put(self.rng.randbytes(self.rng.choice([4, 32, 36, 40])), b"")

    def flip_data_mdb(self) -> None:
        """Bits flipped in `data.mdb` itself, between two runs of the tier, inside the bytes of
        stored records (LMDB keeps no checksums: they read back damaged or, still decoding,
        wrong). Not in LMDB's own page structure: some damage there (its free list) trips
        LMDB's internal assertions, which abort the process whatever the caller does."""
        values = self._stored_values()
        self.close()
        (path,) = self.root.glob("*/index/data.mdb")
        data = bytearray(path.read_bytes())
        for value in self.rng.sample(values, min(len(values), self.rng.randint(1, 4))):
            at = data.find(value)
            if at >= 0:
                data[at + self.rng.randrange(len(value))] ^= 1 << self.rng.randrange(8)
        path.write_bytes(bytes(data))
        self.tier = self._open()

    def _stored_values(self) -> list[bytes]:
        if self.tier._store is None:
            return []
        index = store_of(self.tier).index
        with index.env.begin() as txn:
            return [
                bytes(v)
                for db in (index.blocks, index.segments_db)
                for v in txn.cursor(db=db).iternext(keys=False, values=True)
                if v
            ]

    def damages(self) -> list[Callable[[], None]]:
        return [
            self.flip_segment_bytes, self.truncate_segment, self.delete_segment,
            self.damage_index_value, self.damage_index_value, self.damage_index_entries,
            self.flip_data_mdb, self.reopen,
        ]  # fmt: skip


@pytest.mark.slow
def test_random_damage_is_healed_and_never_serves_wrong_kv(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    harness = Harness(tmp_path, rng)
    try:
        for trial in range(NUM_TRIALS):
            harness.write_some()
            rng.choice(harness.damages())()
            harness.use()
            if trial % HEAL_EVERY == HEAL_EVERY - 1:
                harness.heal_and_check()
        harness.reopen()
        harness.heal_and_check()
    finally:
        harness.close()
    assert harness.num_served > NUM_TRIALS // 2, "too few hits: the damage is not being survived"
    totals = harness.totals
    assert totals["corrupt"] and totals["checksum"] and totals["repairs"], totals
