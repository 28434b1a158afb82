"""`HostTier`: the host-RAM tier of the prefix cache, between the device pool and the disk.

Block payloads (the bytes of one block's KV, all the same size for one model) are kept in slots of
a `SlotArena`, keyed by block hash, in LRU order, within a byte budget fixed at construction
(`max_bytes // payload_bytes` slots). Everything is in memory: nothing survives a restart.

Threads: every method may be called from any thread (the event loop asks `contains_prefix`; the
forward thread offers and leases). One lock guards the bookkeeping and is never held while
payload bytes are copied:

- `offer` takes a slot under the lock (a free one, else the least recently used entry that is
  not leased), copies the payload outside it, then publishes the entry. An entry is visible only
  once its bytes are complete.
- `lease` hands out views of the slots of a prefix of hashes, without copying; leased entries are
  never evicted (so never overwritten) until `release`. `load` is lease + copy + release.

Invariants (`check_integrity`): every slot is exactly one of free, being filled, or held by one
entry; the LRU order holds exactly the entries; lease counts are non-negative.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.free_queue import require
from deepinfer.config import Retention
from deepinfer.kv_events.recorder import BlockOrigin, MediumEvents
from deepinfer.tiers.host.arena import ChunkAllocator, SlotArena, allocate_bytearray
from deepinfer.tiers.stats import HostTierStats


@dataclass
class _Entry:
    slot: int
    leases: int = 0


class HostTier:
    def __init__(
        self,
        payload_bytes: int,
        max_bytes: int,
        allocate: ChunkAllocator = allocate_bytearray,
        *,
        preallocate: bool = False,
    ) -> None:
        """`payload_bytes`: size of every block payload. `max_bytes`: the budget (at least one
        block). `allocate`/`preallocate`: see `SlotArena` (pinned chunks on CUDA)."""
        if payload_bytes < 1 or max_bytes < payload_bytes:
            raise ValueError(
                f"the host cache budget ({max_bytes} bytes) must hold at least one block of "
                f"{payload_bytes} bytes: raise max_bytes"
            )
        self.payload_bytes = payload_bytes
        self.num_slots = max_bytes // payload_bytes
        self._arena = SlotArena(payload_bytes, self.num_slots, allocate, preallocate=preallocate)
        self._lock = threading.Lock()
        self._entries: OrderedDict[BlockHash, _Entry] = OrderedDict()
        """Published entries, least recently used first."""
        self._filling: dict[BlockHash, int] = {}
        """Slots taken by offers whose bytes are being copied (not yet visible)."""
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._num = dict.fromkeys(("lookups", "hits", "offers", "dropped", "evictions"), 0)
        self.events: MediumEvents | None = None
        """Where stores and evictions are published (None: KV events off)."""

    # lookups

    def contains_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading hashes are held now (a later `lease` may still miss: evictions)."""
        with self._lock:
            n = 0
            for block_hash in block_hashes:
                if block_hash not in self._entries:
                    break
                n += 1
            return n

    def lease(self, block_hashes: Sequence[BlockHash]) -> list[memoryview]:
        """Views of the payloads of the longest held prefix of `block_hashes`, most recently used
        now. The entries stay put until `release(block_hashes[:len(result)])`: call it as soon
        as the bytes are consumed, in a `finally`."""
        views = []
        with self._lock:
            for block_hash in block_hashes:
                entry = self._entries.get(block_hash)
                if entry is None:
                    break
                entry.leases += 1
                self._entries.move_to_end(block_hash)
                views.append(self._arena.view(entry.slot))
            self._num["lookups"] += len(block_hashes)
            self._num["hits"] += len(views)
        return views

    def release(self, block_hashes: Sequence[BlockHash]) -> None:
        """End the leases taken by `lease` on these hashes."""
        with self._lock:
            for block_hash in block_hashes:
                entry = self._entries[block_hash]
                assert entry.leases > 0, "release without a lease"
                entry.leases -= 1

    def load(self, block_hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """Copies of the payloads, None where absent (looked up one by one, not as a prefix)."""
        out: list[bytes | None] = []
        for block_hash in block_hashes:
            views = self.lease([block_hash])
            if not views:
                out.append(None)
                continue
            try:
                out.append(bytes(views[0]))
            finally:
                self.release([block_hash])
        return out

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        """Hits served from another tier: held entries become the most recently used."""
        with self._lock:
            for block_hash in block_hashes:
                if block_hash in self._entries:
                    self._entries.move_to_end(block_hash)

    # writes

    def offer(
        self,
        block_hash: BlockHash,
        payload: bytes | memoryview,
        retention: str | None = None,
        origin: BlockOrigin | None = None,
    ) -> bool:
        """Store a copy of a block's payload, evicting the least recently used unleased entry
        when full. True when the block is held (or being stored by another thread) afterwards;
        False when not stored: `none` retention, or every slot is leased or being filled
        (counted as dropped). `origin`: what its `BlockStored` event carries (events on)."""
        data = memoryview(payload).cast("B")
        if data.nbytes != self.payload_bytes:
            raise ValueError(
                f"host cache payloads are {self.payload_bytes} bytes, not {data.nbytes}"
            )
        if retention == Retention.NONE:
            return False
        with self._lock:
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)
                return True
            if block_hash in self._filling:
                return True
            slot = self._take_slot_locked()
            if slot is None:
                self._num["dropped"] += 1
                return False
            self._filling[block_hash] = slot
            target = self._arena.view(slot)
        try:
            target[:] = data
        except BaseException:
            with self._lock:
                self._free_slots.append(self._filling.pop(block_hash))
            raise
        with self._lock:
            self._entries[block_hash] = _Entry(self._filling.pop(block_hash))
            self._num["offers"] += 1
        if self.events is not None and origin is not None:
            self.events.stored_one(block_hash, origin)
        return True

    def _take_slot_locked(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, entry in self._entries.items():
            if entry.leases == 0:
                del self._entries[block_hash]
                self._num["evictions"] += 1
                if self.events is not None:
                    self.events.removed([block_hash])
                return entry.slot
        return None

    def lru_hashes(self) -> list[BlockHash]:
        """Held hashes, the next to be evicted first (O(blocks): for tests and debugging)."""
        with self._lock:
            return list(self._entries)

    # accounting

    def stats(self) -> HostTierStats:
        with self._lock:
            num_blocks, n = len(self._entries), dict(self._num)
        return HostTierStats(
            num_blocks=num_blocks, num_bytes=num_blocks * self.payload_bytes,
            capacity_bytes=self.num_slots * self.payload_bytes, num_lookups=n["lookups"],
            num_hits=n["hits"], num_offers=n["offers"], num_offers_dropped=n["dropped"],
            num_evictions=n["evictions"],
        )  # fmt: skip

    def check_integrity(self) -> None:
        """Slots partition into free, filling and held; entries and counters are sane."""
        with self._lock:
            held = [e.slot for e in self._entries.values()]
            slots = held + list(self._filling.values()) + self._free_slots
            require(len(slots) == self.num_slots, f"{len(slots)} slots of {self.num_slots}")
            require(sorted(slots) == list(range(self.num_slots)), "a slot is lost or shared")
            require(all(e.leases >= 0 for e in self._entries.values()), "negative lease count")
            require(not self._filling.keys() & self._entries.keys(), "an entry is also filling")
            require(self._num["hits"] <= self._num["lookups"], "more hits than lookups")
