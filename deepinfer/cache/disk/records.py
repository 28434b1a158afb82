"""What the disk tier persists: index records (msgspec, in LMDB) and their keys, and checksums.

Keys are fixed-width and big-endian so LMDB's byte order is the order we scan in:
- `blocks`:   block hash (32 bytes) -> `BlockRecord`
- `lru`:      u64 last access (µs) || hash -> b""      (oldest first: eviction order)
- `expiry`:   u64 expiry (µs) || hash -> b""           (soonest first: sweep order)
- `segments`: u32 segment id -> `SegmentInfo`
"""

from __future__ import annotations

import hashlib
import struct

import msgspec

from deepinfer.cache.block_hash import HASH_NUM_BYTES, BlockHash

CHECKSUM_NUM_BYTES = 16
_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")


class BlockRecord(msgspec.Struct, frozen=True, array_like=True):
    """Where one block's payload lives and how long it is kept."""

    segment: int
    offset: int
    """Byte offset of the record header in the segment file."""
    length: int
    """Payload bytes (the header is not counted)."""
    checksum: bytes
    """blake2b-128 over hash || payload (see `checksum`)."""
    num_tokens: int
    created_s: float
    last_access_s: float
    retention: str
    expires_s: float


class SegmentInfo(msgspec.Struct, frozen=True, array_like=True):
    """Accounting for one segment file."""

    size_bytes: int
    """Bytes appended so far (committed or not: a crash may leave unindexed bytes)."""
    live_bytes: int
    """Bytes (header + payload) of records the index still points to."""
    num_live: int


_record_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(BlockRecord)
_segment_decoder = msgspec.msgpack.Decoder(SegmentInfo)


def encode(value: BlockRecord | SegmentInfo) -> bytes:
    return _record_encoder.encode(value)


def decode_record(data: bytes | memoryview) -> BlockRecord:
    return _record_decoder.decode(data)


def decode_segment(data: bytes | memoryview) -> SegmentInfo:
    return _segment_decoder.decode(data)


def checksum(block_hash: BlockHash, payload: bytes | memoryview) -> bytes:
    """Binds a payload to its key: a record read from the wrong place never verifies."""
    h = hashlib.blake2b(block_hash, digest_size=CHECKSUM_NUM_BYTES)
    h.update(payload)
    return h.digest()


def time_key(t_s: float, block_hash: BlockHash) -> bytes:
    """Key of the `lru` and `expiry` tables: time in whole microseconds, then the hash."""
    return _U64.pack(max(0, int(t_s * 1e6))) + block_hash


def hash_of_time_key(key: bytes) -> BlockHash:
    return bytes(key[_U64.size :])


def segment_key(segment: int) -> bytes:
    return _U32.pack(segment)


def segment_of_key(key: bytes) -> int:
    return int(_U32.unpack(key)[0])


def check_hash(block_hash: bytes) -> None:
    assert len(block_hash) == HASH_NUM_BYTES, f"block hash must be {HASH_NUM_BYTES} bytes"
