"""`SegmentStore`: append-only segment files holding block payloads, each behind a header.

Record layout (little-endian): magic "DKV1" | u32 payload length | 32-byte block hash |
16-byte checksum (blake2b-128 over hash || payload) | payload. A read checks all of it against the
index record, so a torn, truncated, overwritten or misplaced record is detected and never served.

One thread appends (the tier's writer); any thread may read. Writes go to the active segment only,
and a process never appends to a segment it did not create: after a restart (or a crash that left
a torn tail) writing resumes in a fresh file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
from pathlib import Path

from deepinfer.cache.block_hash import HASH_NUM_BYTES, BlockHash
from deepinfer.tiers.disk.records import CHECKSUM_NUM_BYTES, MAX_SEGMENT_ID, checksum

MAGIC = b"DKV1"
HEADER = struct.Struct(f"<4sI{HASH_NUM_BYTES}s{CHECKSUM_NUM_BYTES}s")
SUFFIX = ".seg"

RawRecord = tuple[bytes, bytes]
"""A record as read from its segment, (header bytes, payload bytes), not yet verified."""


def record_bytes(payload_len: int) -> int:
    """Bytes a record takes in its segment (header included)."""
    return HEADER.size + payload_len


def record_fits(offset: int, length: int, file_bytes: int) -> bool:
    """Whether a record of `length` payload bytes at `offset` lies inside a file this long (an
    index record saying otherwise is damaged: nothing is read or allocated for it)."""
    return offset >= 0 and length >= 0 and offset + HEADER.size + length <= file_bytes


def split_record(data: bytes) -> RawRecord:
    """A record's bytes as read, cut into (header, payload): a short read leaves a short part."""
    return data[: HEADER.size], data[HEADER.size :]


def parse_record(raw: RawRecord, length: int, block_hash: BlockHash, digest: bytes) -> bytes | None:
    """The payload if `raw` (a record as read) is intact and is `block_hash`'s: the lengths,
    header and checksum all match the index record. Else None."""
    header, payload = raw
    if len(header) != HEADER.size or len(payload) != length:
        return None
    magic, n, h, d = HEADER.unpack(header)
    if magic != MAGIC or n != length or h != block_hash or d != digest:
        return None
    return payload if checksum(block_hash, payload) == digest else None


def segment_name(segment: int) -> str:
    return f"{segment:010d}{SUFFIX}"


class SegmentStore:
    def __init__(self, directory: Path, segment_bytes: int) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self._fd: int | None = None
        self.active: int | None = None
        """Segment being appended to (None before the first append)."""
        self.active_size = 0

    def path(self, segment: int) -> Path:
        return self.directory / segment_name(segment)

    def list_segments(self) -> list[int]:
        """Segment ids with a file on disk, ascending."""
        ids = []
        for p in self.directory.glob(f"*{SUFFIX}"):
            if p.stem.isdigit() and int(p.stem) <= MAX_SEGMENT_ID:
                ids.append(int(p.stem))
        return sorted(ids)

    def file_bytes(self, segment: int) -> int:
        try:
            return self.path(segment).stat().st_size
        except FileNotFoundError:
            return 0

    def start(self, segment: int) -> None:
        """Close the active segment and begin appending to a new, empty one."""
        self.close()
        fd = os.open(self.path(segment), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._fd, self.active, self.active_size = fd, segment, 0
        _fsync_dir(self.directory)

    def is_full(self) -> bool:
        """True when appending needs a new segment: none yet, this one full, or its file deleted
        behind our back (appends to it would be unreadable)."""
        if self._fd is None or self.active_size >= self.segment_bytes:
            return True
        return os.fstat(self._fd).st_nlink == 0

    def append(self, block_hash: BlockHash, payload: bytes) -> tuple[int, int, bytes]:
        """Write one record at the end of the active segment (not yet durable: call `sync`).

        Returns (offset, record bytes, checksum). On OSError the caller rolls back with
        `truncate_to`.
        """
        assert self._fd is not None, "start a segment before appending"
        digest = checksum(block_hash, payload)
        header = HEADER.pack(MAGIC, len(payload), block_hash, digest)
        offset = self.active_size
        _pwrite_all(self._fd, header + payload, offset)
        self.active_size += len(header) + len(payload)
        return offset, len(header) + len(payload), digest

    def sync(self) -> None:
        """Make every appended record durable (before its index entry may commit)."""
        if self._fd is not None:
            os.fsync(self._fd)

    def truncate_to(self, size: int) -> None:
        """Drop the active segment's tail after a failed batch (best effort: bytes left behind
        are unindexed and only cost space until the segment is reclaimed)."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, size)
            self.active_size = size
        except OSError:
            self.active_size = max(self.active_size, size)

    def read(
        self, segment: int, offset: int, length: int, block_hash: BlockHash, digest: bytes
    ) -> bytes | None:
        """The payload if the record at (segment, offset) is intact and is `block_hash`'s, else
        None. A missing or short file also reads as None."""
        raw = self.read_raw(segment, offset, length)
        return None if raw is None else parse_record(raw, length, block_hash, digest)

    def read_raw(self, segment: int, offset: int, length: int) -> RawRecord | None:
        """The record as read, unverified (see `parse_record`); None when the file is missing or
        too short to hold it."""
        try:
            fd = os.open(self.path(segment), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            if not record_fits(offset, length, os.fstat(fd).st_size):
                return None  # a damaged record, or a truncated file: never allocate for it
            data = os.pread(fd, HEADER.size + length, offset)
        finally:
            os.close(fd)
        return split_record(data)

    def delete(self, segment: int) -> None:
        """Remove a segment file (its index entries must be gone already)."""
        if segment == self.active:
            self.close()
        with contextlib.suppress(FileNotFoundError):
            self.path(segment).unlink()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self.active, self.active_size = None, None, 0


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write to a segment file")
        view, offset = view[n:], offset + n


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
