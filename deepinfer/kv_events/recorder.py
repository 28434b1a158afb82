"""`KVEventRecorder`: where the tiers record KV events, from any thread, without blocking.

The device pool, the host tier and the disk tier each hold a `MediumEvents` (their medium's
view of one recorder) or None when events are off. Recording appends to a bounded list under a
lock (microseconds); the publisher's thread takes the list after each engine step and sends it
as one batch. An event the full list cannot take is dropped and counted (`num_dropped`): a
publisher that falls behind costs routers events, never serving time.

Consecutive removals of one medium merge into one `BlockRemoved`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

from deepinfer.kv_events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    HashFormat,
    external_hash,
)


class BlockOrigin(NamedTuple):
    """What a block's `BlockStored` carries besides its hash: its parent's hash (None: the
    first block of its sequence) and its tokens."""

    parent: bytes | None
    token_ids: tuple[int, ...]


class KVEventRecorder:
    def __init__(self, block_size: int, hash_format: HashFormat, max_events: int) -> None:
        self.block_size = block_size
        self.hash_format: HashFormat = hash_format
        self._max_events = max_events
        self._lock = threading.Lock()
        self._pending: list[Event] = []
        self._num_pending_hashes = 0
        self.num_dropped = 0
        """Events dropped because the pending list was full (a metric)."""
        self.num_recorded = 0

    def medium(self, name: str) -> MediumEvents:
        return MediumEvents(self, name)

    def stored(
        self,
        medium: str,
        block_hashes: Sequence[bytes],
        parent: bytes | None,
        token_ids: Sequence[int],
    ) -> None:
        if not block_hashes:
            return
        fmt = self.hash_format
        event = BlockStored(
            block_hashes=[external_hash(h, fmt) for h in block_hashes],
            parent_block_hash=None if parent is None else external_hash(parent, fmt),
            token_ids=list(token_ids),
            block_size=self.block_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )
        self._add(event, len(block_hashes))

    def removed(self, medium: str, block_hashes: Sequence[bytes]) -> None:
        if not block_hashes:
            return
        wire = [external_hash(h, self.hash_format) for h in block_hashes]
        with self._lock:
            last = self._pending[-1] if self._pending else None
            if isinstance(last, BlockRemoved) and last.medium == medium and self._room(len(wire)):
                last.block_hashes.extend(wire)
                self._num_pending_hashes += len(wire)
                self.num_recorded += 1
                return
        self._add(BlockRemoved(block_hashes=wire, medium=medium), len(wire))

    def cleared(self) -> None:
        self._add(AllBlocksCleared(), 1)

    def _room(self, size: int) -> bool:
        return self._num_pending_hashes + size <= self._max_events

    def _add(self, event: Event, size: int) -> None:
        with self._lock:
            if not self._room(size):
                self.num_dropped += 1
                return
            self._pending.append(event)
            self._num_pending_hashes += size
            self.num_recorded += 1

    def take(self) -> list[Event]:
        """Every event recorded since the last take, in order."""
        with self._lock:
            events, self._pending = self._pending, []
            self._num_pending_hashes = 0
        return events


class MediumEvents:
    """One tier's view of the recorder: its medium's stored and removed blocks."""

    def __init__(self, recorder: KVEventRecorder, medium: str) -> None:
        self.recorder = recorder
        self.medium = medium

    def stored(
        self, block_hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int]
    ) -> None:
        self.recorder.stored(self.medium, block_hashes, parent, token_ids)

    def removed(self, block_hashes: Sequence[bytes]) -> None:
        self.recorder.removed(self.medium, block_hashes)

    def stored_one(self, block_hash: bytes, origin: BlockOrigin) -> None:
        self.recorder.stored(self.medium, [block_hash], origin.parent, origin.token_ids)
