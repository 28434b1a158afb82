"""`BlockPool`: the device tier's blocks, their reference counts, and the prefix-cache map.

Block 0 is reserved as the null block: it is never allocated, never freed and never cached, so
runners may pad block tables (and point padding tokens' KV writes) at block 0 without touching
anyone's data. The pool therefore has `num_blocks - 1` usable blocks.

Every other block is in exactly one of two states:
- in use: `ref_count >= 1` (one per request holding it; shared prefix blocks have several);
- free: `ref_count == 0`, in the LRU free queue. A free block keeps its content and hash and can
  still be hit; it is evicted (hash dropped) only when the head of the queue is reallocated.

The queue's order also keeps resident memory near the working set where the KV tensors are
reserved but untouched until written (CPU, see `kv_layout.reserve_zeros`): freed blocks without
a hash are reused first, then never-used blocks in id order (low ids first, so the written part
stays one compact range), and only then cached blocks, least recently freed first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.free_queue import Block, FreeBlockQueue, require
from deepinfer.kv_events.recorder import MediumEvents

NULL_BLOCK_ID = 0


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self._free = FreeBlockQueue()
        for block in self.blocks[1:]:
            self._free.append(block)
        self._cached: dict[BlockHash, Block] = {}
        self.num_evictions = 0
        """Cached blocks whose content was dropped to reuse them (a counter for metrics)."""
        self.events: MediumEvents | None = None
        """Where evictions are published as `BlockRemoved` (None: KV events off)."""

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (free, cached or not)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose hash is registered (in use or free)."""
        return len(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[Block]:
        """Take `num_blocks` blocks from the head of the free queue, evicting their old content.

        The caller checks `num_free_blocks` first; asking for more is a bug.
        """
        assert num_blocks <= len(self._free), f"allocate({num_blocks}) with {len(self._free)} free"
        out = []
        for _ in range(num_blocks):
            block = self._free.pop_left()
            self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each block (a prefix-cache hit); free ones leave the queue."""
        for block in blocks:
            if block.ref_count == 0:
                self._free.remove(block)
            block.ref_count += 1

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference on each block of a request's table (given in table order).

        Blocks reaching zero join the free queue last-block-first, so a request's tail blocks are
        evicted before its head blocks (a shared prefix outlives its continuations). Blocks with
        no hash cannot be hit, so they go to the head to be reused first.
        """
        for block in reversed(blocks):
            assert block.ref_count > 0, f"double free of block {block.block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._free.append_left(block)
                else:
                    self._free.append(block)

    def cache_block(self, block: Block, block_hash: BlockHash) -> bool:
        """Register a full, computed block under its hash. Returns False when not registered:
        caching is off, or another block already holds the same content (the first one wins; this
        block stays unhashed and is reused first once freed).
        """
        assert block.ref_count > 0 and block is not self.null_block
        if not self.enable_caching or block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.events is not None:
                self.events.removed([block.block_hash])
            del self._cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1

    def free_block_ids(self) -> list[int]:
        """The free queue, next to be reused first (O(blocks): for tests and debugging)."""
        return [b.block_id for b in self._free]

    def reset_prefix_cache(self) -> int:
        """Drop the hashes of all free blocks (in-use blocks keep theirs). Returns how many.

        The dropped blocks move to the head of the queue, in their order, like any free block
        without a hash: reusing them before never-used blocks keeps the pool's written (resident)
        part as small as the load allows."""
        dropped = [b for b in self._free if b.block_hash is not None]
        for block in reversed(dropped):
            self._evict(block)
            self._free.remove(block)
            self._free.append_left(block)
        return len(dropped)

    def check_integrity(self) -> None:
        """The free queue holds exactly the ref-0 blocks, the hash map mirrors the blocks' hashes,
        and the null block is untouched."""
        self._free.check_integrity()
        null = self.null_block
        require(null.ref_count == 0 and null.block_hash is None, "null block was used")
        require(null not in self._free, "null block is in the free queue")
        queued = {b.block_id for b in self._free}
        require(len(queued) == len(self._free), "a block is queued twice")
        for block in self.blocks[1:]:
            require(block.ref_count >= 0, f"block {block.block_id} ref_count < 0")
            in_queue = block.block_id in queued
            require(
                in_queue == (block.ref_count == 0),
                f"block {block.block_id}: ref_count {block.ref_count}, queued {in_queue}",
            )
            if block.block_hash is not None:
                require(
                    self._cached.get(block.block_hash) is block,
                    f"block {block.block_id} has a hash the map does not point back from",
                )
        for block_hash, block in self._cached.items():
            require(
                block.block_hash == block_hash, f"map entry for block {block.block_id} is stale"
            )
        require(self.enable_caching or not self._cached, "blocks cached with caching disabled")
