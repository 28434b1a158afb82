"""`HeldBlocks`: blocks of the pool held outside any request: free blocks reserved to be filled
(by a lower tier, see `tiers/device_blocks.py`) before any request holds them, and blocks pinned
while they are copied out. The manager's integrity check counts them as holders.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.block_pool import BlockPool
from deepinfer.cache.free_queue import Block


class HeldBlocks:
    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._held: dict[int, list[Block]] = {}
        self._next = 0

    def _hold(self, blocks: list[Block]) -> int:
        self._next += 1
        self._held[self._next] = blocks
        return self._next

    def reserve(self, num_blocks: int) -> tuple[int, list[int]]:
        """Take free blocks: (reservation id, block ids)."""
        blocks = self._pool.allocate(num_blocks)
        return self._hold(blocks), [b.block_id for b in blocks]

    def commit(self, reservation: int, block_hashes: Sequence[BlockHash]) -> int:
        """Register the first `len(block_hashes)` reserved blocks and release them all to the
        free queue, cached. Returns how many were registered."""
        blocks = self._held.pop(reservation)
        registered = 0
        for block, block_hash in zip(blocks, block_hashes, strict=False):
            registered += self._pool.cache_block(block, block_hash)
        self._pool.free(blocks)
        return registered

    def pin(self, block_ids: Sequence[int]) -> int:
        blocks = [self._pool.blocks[i] for i in block_ids]
        self._pool.touch(blocks)
        return self._hold(blocks)

    def release(self, hold: int) -> None:
        self._pool.free(self._held.pop(hold))

    def count(self, holders: list[int]) -> None:
        """Add one to `holders[block_id]` for each held block (integrity checks)."""
        for blocks in self._held.values():
            for block in blocks:
                holders[block.block_id] += 1
