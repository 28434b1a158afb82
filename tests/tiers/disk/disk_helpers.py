"""Shared by the disk-tier healing tests: blocks, configs, clocks, and ways to damage the files."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import msgspec

from deepinfer.tiers.disk import DiskTier, DiskTierConfig
from deepinfer.tiers.disk.store import DiskStore

FP = "heal-test-model"
GARBAGE = b"\xc1 not msgpack at all"
"""0xc1 is never used by msgpack: no decoder accepts this."""


class Clock:
    """A settable clock (wall or monotonic seconds)."""

    def __init__(self, now_s: float) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def h(i: int) -> bytes:
    return hashlib.sha256(b"heal-h%d" % i).digest()


def payload(i: int, n: int = 2048) -> bytes:
    return (hashlib.sha256(b"heal-p%d" % i).digest() * (n // 32 + 1))[:n]


def cfg(root: Path, **kw: object) -> DiskTierConfig:
    base: dict[str, object] = dict(
        cache_dir=root, max_bytes=1 << 20, segment_bytes=16 << 10, sweep_interval_s=3600.0
    )
    base.update(kw)
    return DiskTierConfig(**base)  # type: ignore[arg-type]


def make_tier(root: Path, mono: Clock | None = None, **kw: object) -> DiskTier:
    tier = DiskTier(
        FP, cfg(root, **kw), clock=Clock(1_700_000_000.0), monotonic=mono or Clock(1000.0)
    )
    tier.open()
    return tier


def write(tier: DiskTier, ids: range | list[int]) -> None:
    for i in ids:
        assert tier.offer(h(i), payload(i), 16)
    assert tier.flush(10)


def store_of(tier: DiskTier) -> DiskStore:
    store = tier._store
    assert store is not None, "the tier has no open store"
    return store


def put_raw(env: lmdb.Environment, db: lmdb._Database, key: bytes, value: bytes) -> None:
    """Overwrite one LMDB value, bypassing the tier (an open tier's env and table handle)."""
    with env.begin(write=True) as txn:
        txn.put(key, value, db=db)


def damage_closed_index(root: Path, table: bytes, key: bytes, value: bytes) -> None:
    """Overwrite a value in the index of a closed tier, through lmdb directly."""
    (index_dir,) = root.glob("*/index")
    env = lmdb.open(str(index_dir), max_dbs=8, map_size=64 << 20)
    try:
        put_raw(env, env.open_db(table), key, value)
    finally:
        env.close()


def msgpack(value: object) -> bytes:
    return msgspec.msgpack.encode(value)


def wait_until(cond: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
