"""Opening the disk store, and setting a damaged index aside.

An index LMDB cannot use (not an LMDB file, a damaged tree, another format version) is never
deleted: the writer renames its folder to `index.broken-<UTC time>` (kept for inspection; remove
it by hand), logs one warning, and starts an empty index. The segment files the old index named
are then unknown, and `DiskStore.recover` deletes them, so their disk space comes back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import lmdb

from deepinfer.tiers.disk.config import DiskTierConfig
from deepinfer.tiers.disk.index_files import IndexFileChangedError
from deepinfer.tiers.disk.store import DiskStore

logger = logging.getLogger(__name__)

BROKEN_INDEX_ERRORS = (
    lmdb.InvalidError,
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.VersionMismatchError,
    lmdb.IncompatibleError,
    lmdb.BadValsizeError,
    lmdb.MemoryError,
    IndexFileChangedError,
)
"""LMDB's ways of saying the file itself is unusable (reopening it would fail again); ENOMEM
is among them: a damaged header asks for a map no address space holds. So is a mapped file
truncated or replaced under the running index."""


def open_store(
    directory: Path,
    config: DiskTierConfig,
    readonly: bool,
    now_s: float,
    on_corrupt: Callable[[int], None],
    reset_reason: str | None = None,
) -> tuple[DiskStore, bool]:
    """Open (and, as the writer, recover) the store. As the writer, an index that cannot be
    used, or any index when a `reset_reason` is given, is moved aside first and replaced by an
    empty one. Returns (store, whether the index was reset). Other failures raise (OSError,
    lmdb.Error)."""
    index_dir = directory / "index"
    reset = reset_reason is not None and not readonly and index_dir.exists()
    if reset:
        move_aside(index_dir, now_s, str(reset_reason))
    try:
        return _open(directory, config, readonly, on_corrupt), reset
    except BROKEN_INDEX_ERRORS as exc:
        if readonly:
            raise
        move_aside(index_dir, now_s, f"{type(exc).__name__}: {exc}")
    return _open(directory, config, readonly, on_corrupt), True


def _open(
    directory: Path, config: DiskTierConfig, readonly: bool, on_corrupt: Callable[[int], None]
) -> DiskStore:
    store = DiskStore(directory, config, readonly=readonly, on_corrupt=on_corrupt)
    try:
        if not readonly:
            store.recover()
    except BaseException:
        store.close()
        raise
    return store


def move_aside(path: Path, now_s: float, reason: str) -> Path:
    """Rename `path` to `<name>.broken-<UTC time>[-n]` (never over an earlier one)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now_s))
    target = path.with_name(f"{path.name}.broken-{stamp}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.broken-{stamp}-{n}")
        n += 1
    path.rename(target)
    logger.warning(
        "disk cache index %s cannot be used (%s): moved to %s, starting an empty index "
        "(the segment files it named are reclaimed)",
        path, reason, target.name,
    )  # fmt: skip
    return target
