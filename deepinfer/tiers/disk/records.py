"""What the disk tier persists: index records (msgspec, in LMDB) and their keys, and checksums.

Keys are fixed-width and big-endian so LMDB's byte order is the order we scan in:
- `blocks`:   block hash (32 bytes) -> `BlockRecord`
- `lru`:      u64 last access (µs) || hash -> b""      (oldest first: eviction order)
- `expiry`:   u64 expiry (µs) || hash -> b""           (soonest first: sweep order)
- `segments`: u32 segment id -> `SegmentInfo`

Anything read back may be damaged (a bad disk, a stray write): the `try_*` decoders return None
instead of raising, and the structs' constraints reject values no writer produces (negative
offsets, segment ids beyond u32, checksums of the wrong size), so a damaged record is a miss.
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Annotated

import msgspec

from deepinfer.cache.block_hash import HASH_NUM_BYTES, BlockHash

CHECKSUM_NUM_BYTES = 16
_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")
_MAX_U64 = (1 << 64) - 1
TIME_KEY_NUM_BYTES = _U64.size + HASH_NUM_BYTES

Count = Annotated[int, msgspec.Meta(ge=0)]
MAX_SEGMENT_ID = (1 << 31) - 1
"""Far beyond any real id (one per filled segment), so `id + 1` always packs as u32."""
NEXT_SEGMENT = b"next_segment"
"""Key, in the `meta` table, of the next segment id to hand out."""
SegmentId = Annotated[int, msgspec.Meta(ge=0, le=MAX_SEGMENT_ID)]
Digest = Annotated[
    bytes, msgspec.Meta(min_length=CHECKSUM_NUM_BYTES, max_length=CHECKSUM_NUM_BYTES)
]
DECODE_ERRORS = (msgspec.DecodeError, ValueError, TypeError, IndexError, struct.error)
"""What decoding damaged bytes may raise (msgspec's validation errors are DecodeErrors)."""


class BlockRecord(msgspec.Struct, frozen=True, array_like=True):
    """Where one block's payload lives and how long it is kept."""

    segment: SegmentId
    offset: Count
    """Byte offset of the record header in the segment file."""
    length: Count
    """Payload bytes (the header is not counted)."""
    checksum: Digest
    """blake2b-128 over hash || payload (see `checksum`)."""
    num_tokens: Count
    created_s: float
    last_access_s: float
    retention: str
    expires_s: float


class SegmentInfo(msgspec.Struct, frozen=True, array_like=True):
    """Accounting for one segment file."""

    size_bytes: Count
    """Bytes appended so far (committed or not: a crash may leave unindexed bytes)."""
    live_bytes: Count
    """Bytes (header + payload) of records the index still points to."""
    num_live: Count


_record_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(BlockRecord)
_segment_decoder = msgspec.msgpack.Decoder(SegmentInfo)


def encode(value: BlockRecord | SegmentInfo) -> bytes:
    return _record_encoder.encode(value)


def decode_record(data: bytes | memoryview) -> BlockRecord:
    return _record_decoder.decode(data)


def decode_segment(data: bytes | memoryview) -> SegmentInfo:
    return _segment_decoder.decode(data)


def try_decode_record(key: bytes | memoryview, data: bytes | memoryview) -> BlockRecord | None:
    """The record stored under `key` in `blocks`, or None when key or value is damaged."""
    if len(key) != HASH_NUM_BYTES:
        return None
    try:
        return decode_record(data)
    except DECODE_ERRORS:
        return None


def try_decode_segment(
    key: bytes | memoryview, data: bytes | memoryview
) -> tuple[int, SegmentInfo] | None:
    """(segment id, info) of a `segments` entry, or None when key or value is damaged."""
    segment = try_segment_of_key(key)
    if segment is None:
        return None
    try:
        return segment, decode_segment(data)
    except DECODE_ERRORS:
        return None


def checksum(block_hash: BlockHash, payload: bytes | memoryview) -> bytes:
    """Binds a payload to its key: a record read from the wrong place never verifies."""
    h = hashlib.blake2b(block_hash, digest_size=CHECKSUM_NUM_BYTES)
    h.update(payload)
    return h.digest()


def time_key(t_s: float, block_hash: BlockHash) -> bytes:
    """Key of the `lru` and `expiry` tables: time in whole microseconds (clamped to u64, so a
    damaged time still makes a key), then the hash."""
    t_us = t_s * 1e6
    micros = 0 if math.isnan(t_us) else int(min(max(t_us, 0.0), float(_MAX_U64)))
    return _U64.pack(min(micros, _MAX_U64)) + block_hash


def hash_of_time_key(key: bytes) -> BlockHash | None:
    """The hash in a `lru` / `expiry` key; None for a damaged key (wrong size)."""
    return bytes(key[_U64.size :]) if len(key) == TIME_KEY_NUM_BYTES else None


def segment_key(segment: int) -> bytes:
    return _U32.pack(segment)


def segment_of_key(key: bytes) -> int:
    return int(_U32.unpack(key)[0])


def try_segment_of_key(key: bytes | memoryview) -> int | None:
    """The id in a `segments` key (or the next-id counter); None when damaged."""
    if len(key) != _U32.size:
        return None
    segment = int(_U32.unpack(key)[0])
    return segment if segment <= MAX_SEGMENT_ID else None


def check_hash(block_hash: bytes) -> None:
    assert len(block_hash) == HASH_NUM_BYTES, f"block hash must be {HASH_NUM_BYTES} bytes"
