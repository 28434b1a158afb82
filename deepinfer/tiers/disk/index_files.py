"""`MappedFiles`: the two files LMDB memory-maps, watched so that a truncated one is never read.

LMDB maps `data.mdb` (the pages) and `lock.mdb` (the reader table). Touching a mapped page past
the end of a file truncated under the mapping raises SIGBUS, which ends the process whatever
Python does. So the index calls `check` before every transaction (two `fstat`s and two `stat`s,
microseconds): a file shorter than it was (LMDB never shrinks either of them), a `data.mdb`
shorter than the pages its last commit names, or a path that no longer names the mapped file
(replaced, or removed) raises `IndexFileChangedError`, which the keeper treats like any index LMDB
calls damaged: moved aside and rebuilt empty. Only a truncation that lands inside the microseconds
of one transaction can still fault.

Closing an environment writes to its lock file's mapping, so `restore` first extends a truncated
lock file back to its mapped size (zeros: no reader registered); a truncated `data.mdb` is not
touched by closing and is left as found (kept aside for inspection). Segment files are read with
`pread`, never mapped: a truncated segment reads short and fails verification (a miss).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import lmdb

DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"


class IndexFileChangedError(lmdb.Error):
    """A file LMDB maps was truncated, replaced or removed while the index had it open."""


@dataclass
class _Watched:
    path: Path
    fd: int
    """Our own descriptor of the mapped file (the same inode LMDB maps, wherever it moves)."""
    dev_ino: tuple[int, int]
    min_bytes: int
    """The file may never be shorter than this: mapped pages lie below it."""


class MappedFiles:
    def __init__(self, directory: Path, env: lmdb.Environment, readonly: bool) -> None:
        """Watch `env`'s files in `directory` (just opened). Raises `IndexFileChangedError` when
        `data.mdb` is already shorter than the pages its last commit names."""
        self._lock = threading.Lock()
        self._data = _watch(directory / DATA_FILE, os.O_RDONLY)
        try:
            self._lock_file = _watch(directory / LOCK_FILE, os.O_RDONLY if readonly else os.O_RDWR)
        except BaseException:
            os.close(self._data.fd)
            raise
        try:
            self._data.min_bytes = max(self._data.min_bytes, _committed_bytes(env, self._data))
            self.check()
        except BaseException:
            self.close()
            raise

    def check(self) -> None:
        """Raise `IndexFileChangedError` unless both files are still there, whole, and the ones
        mapped. Thread-safe."""
        for watched in (self._data, self._lock_file):
            size = _size(watched)
            with self._lock:
                watched.min_bytes = max(watched.min_bytes, size)  # LMDB grew it: pages lie below

    def restore(self) -> None:
        """Extend a truncated lock file back to its mapped size, so that closing the environment
        writes inside the file (best effort)."""
        watched = self._lock_file
        with contextlib.suppress(OSError):
            if os.fstat(watched.fd).st_size < watched.min_bytes:
                os.ftruncate(watched.fd, watched.min_bytes)

    def close(self) -> None:
        """Release our descriptors: only after the environment is closed (closing any descriptor
        of `lock.mdb` drops the process's POSIX locks on it, which LMDB relies on)."""
        for watched in (self._data, self._lock_file):
            with contextlib.suppress(OSError):
                os.close(watched.fd)


def _watch(path: Path, flags: int) -> _Watched:
    try:
        fd = os.open(path, flags)
    except PermissionError:
        fd = os.open(path, os.O_RDONLY)  # `restore` then cannot extend it
    st = os.fstat(fd)
    return _Watched(path, fd, (st.st_dev, st.st_ino), st.st_size)


def _size(watched: _Watched) -> int:
    """The mapped file's size, once it is checked to be whole and still at its path."""
    size = os.fstat(watched.fd).st_size
    name = watched.path.name
    if size < watched.min_bytes:
        raise IndexFileChangedError(
            f"{name} was truncated to {size} bytes while {watched.min_bytes} are mapped"
        )
    try:
        st = os.stat(watched.path)
    except FileNotFoundError:
        raise IndexFileChangedError(f"{name} was removed while mapped") from None
    if (st.st_dev, st.st_ino) != watched.dev_ino:
        raise IndexFileChangedError(f"{name} was replaced by another file while mapped")
    return size


def _committed_bytes(env: lmdb.Environment, data: _Watched) -> int:
    """Bytes up to the end of the last page the newest commit names. The two meta pages (where
    LMDB keeps that number) are checked to be in the file before they are read."""
    if os.fstat(data.fd).st_size < 2 * mmap.PAGESIZE:
        raise IndexFileChangedError(f"{DATA_FILE} is shorter than its two meta pages")
    return (env.info()["last_pgno"] + 1) * env.stat()["psize"]
