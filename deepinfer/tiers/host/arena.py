"""`SlotArena`: fixed-size payload slots carved out of a few large host buffers.

The host tier never allocates per block: its memory is a handful of chunks, each a writable
byte buffer (a `bytearray` by default; on CUDA the engine hands in page-locked buffers so that
copies to the device are DMA transfers). Chunks are allocated on first use, or all at start-up
with `preallocate` (page-locking is slow and is better paid once, before serving).

Slot `i` lives in chunk `i // slots_per_chunk` at offset `(i % slots_per_chunk) * slot_bytes`.
The arena knows nothing of hashes or LRU: the tier decides which slot holds what, and guarantees
that a slot is never written while a view of it is being read.
"""

from __future__ import annotations

from collections.abc import Callable

ChunkAllocator = Callable[[int], memoryview]
"""Returns a writable, C-contiguous buffer of exactly the requested number of bytes."""

DEFAULT_CHUNK_BYTES = 256 << 20
"""A power of two: pinned-memory allocators round requests up to one, so nothing is wasted."""


def allocate_bytearray(num_bytes: int) -> memoryview:
    """Plain (pageable) memory; the OS maps pages lazily, as they are first written."""
    return memoryview(bytearray(num_bytes))


class SlotArena:
    def __init__(
        self,
        slot_bytes: int,
        num_slots: int,
        allocate: ChunkAllocator = allocate_bytearray,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        preallocate: bool = False,
    ) -> None:
        if slot_bytes < 1 or num_slots < 1:
            raise ValueError(f"an arena needs slots of >= 1 byte, got {num_slots} x {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.slots_per_chunk = max(1, chunk_bytes // slot_bytes)
        self._allocate = allocate
        num_chunks = -(-num_slots // self.slots_per_chunk)
        self._chunks: list[memoryview | None] = [None] * num_chunks
        if preallocate:
            for index in range(num_chunks):
                self._chunk(index)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the chunks allocated so far."""
        return sum(c.nbytes for c in self._chunks if c is not None)

    def _chunk(self, index: int) -> memoryview:
        chunk = self._chunks[index]
        if chunk is None:
            first = index * self.slots_per_chunk
            num_bytes = min(self.slots_per_chunk, self.num_slots - first) * self.slot_bytes
            chunk = self._allocate(num_bytes).cast("B")
            if chunk.readonly or chunk.nbytes != num_bytes:
                raise ValueError(f"chunk allocator returned a bad buffer for {num_bytes} bytes")
            self._chunks[index] = chunk
        return chunk

    def view(self, slot: int) -> memoryview:
        """The slot's bytes, shared (no copy). Allocates its chunk on first use, so callers
        serialise calls (the tier calls it under its lock); the view itself may then be read or
        written without the lock."""
        chunk_index, index = divmod(slot, self.slots_per_chunk)
        offset = index * self.slot_bytes
        return self._chunk(chunk_index)[offset : offset + self.slot_bytes]
