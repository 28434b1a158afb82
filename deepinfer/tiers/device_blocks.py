"""`TierBlocks`: the device pool as the lower tiers (host RAM, disk) see it.

Which of a prompt's leading blocks the device already holds; free blocks reserved to be filled
from a lower tier before any request holds them, then registered under their hashes; blocks
pinned while a lower tier copies them out (a request holding them may finish meanwhile).
The manager's `HeldBlocks` (`cache/held_blocks.py`) keeps the reserved and pinned ones, counted
by its integrity check.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.cache.block_hash import BlockHash, block_hashes_for
from deepinfer.cache.manager import KVCacheManager
from deepinfer.request import Request


class TierBlocks:
    def __init__(self, kv: KVCacheManager) -> None:
        self._pool = kv.pool
        self._block_size = kv.block_size
        self._seed = kv.hash_seed
        self._held = kv.held

    def prompt_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the prompt's blocks a prefix hit may cover (all full blocks but the last
        token's), whatever the request has generated since."""
        max_blocks = (request.num_prompt_tokens - 1) // self._block_size
        ids = request.prompt_token_ids[: max_blocks * self._block_size]
        return block_hashes_for(ids, self._block_size, self._seed, request.cache_salt)

    def cached_blocks(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """The device block ids of the leading hashes cached now."""
        found = []
        for block_hash in block_hashes:
            block = self._pool.get_cached_block(block_hash)
            if block is None:
                break
            found.append(block.block_id)
        return found

    def cached_prefix_len(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading hashes have a device block now."""
        return len(self.cached_blocks(block_hashes)) if self._pool.enable_caching else 0

    def reserve(self, num_blocks: int) -> tuple[int, list[int]] | None:
        """Take free blocks to fill from a lower tier: (reservation id, block ids), or None when
        the pool cannot spare them (keep a margin for running requests)."""
        if not self._pool.enable_caching or num_blocks > self._pool.num_free_blocks // 2:
            return None
        return self._held.reserve(num_blocks)

    def commit(self, reservation: int, block_hashes: Sequence[BlockHash]) -> int:
        """Register the first `len(block_hashes)` reserved blocks (their KV is now filled) and
        release them all to the free queue, cached. Returns how many were registered."""
        return self._held.commit(reservation, block_hashes)

    def pin(self, block_ids: Sequence[int]) -> int:
        """Hold blocks so they are not handed out while a lower tier copies them (a request
        holding them may finish meanwhile). Returns the pin for `unpin`."""
        return self._held.pin(block_ids)

    def unpin(self, pin: int) -> None:
        self._held.release(pin)
