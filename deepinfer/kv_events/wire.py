"""The KV events' wire types, as vLLM 0.34 encodes them (`vllm/distributed/kv_events.py`).

A leaf: msgspec only. A batch is encoded with msgspec's msgpack encoder: `KVEventBatch` as an
array `[ts, events, data_parallel_rank]`, each event as a map tagged `"type": "<class name>"`
(fields with defaults are left out when at their default). Field order is the wire contract;
routers (Dynamo, llm-d, the vLLM router) decode it by position and name.

Block hashes (`ExternalBlockHash`) are ours: the 32-byte chained sha256 of `cache/block_hash.py`,
sent either as the lower 64 bits read big-endian, an unsigned integer (`int64`, the default, as
vLLM does with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`), or as the 32 bytes (`bytes`).
"""

from __future__ import annotations

from typing import Literal

import msgspec

ExternalBlockHash = bytes | int
HashFormat = Literal["int64", "bytes"]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
"""vLLM's name for a disk tier's blocks (`MEDIUM_STORAGE`)."""


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event about blocks of one medium (or all of them)."""


class BlockStored(KVCacheEvent):
    """A run of consecutive blocks of one sequence became available in `medium`:
    `token_ids` are theirs (`len(block_hashes) * block_size` tokens), `parent_block_hash` the
    hash of the block before the run (None: the run starts the sequence)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Forget every block of this publisher (sent first when it starts: nothing cached by an
    earlier process is on the device or in host memory now)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


def external_hash(block_hash: bytes, hash_format: HashFormat) -> ExternalBlockHash:
    """Our 32-byte block hash as the wire carries it."""
    if hash_format == "bytes":
        return block_hash
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A published payload, decoded (for consumers and tests)."""
    return _decoder.decode(payload)
