"""Each running request's block table, and the blocks held outside any request.

`BlockTables`: a request's table is an append-only list of blocks (a freed request's list is
dropped, never reused), so its ids are made again only when it grows: a decode step asks for
every running request's ids and almost never finds a new block.

`HeldBlocks`: blocks reserved to be filled from a lower tier before any request holds them, or
pinned while a lower tier copies them out (a request holding them may finish meanwhile).
"""

from __future__ import annotations

from collections.abc import ItemsView, Sequence

from deepinfer.block_ids import BlockIds
from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.block_pool import Block, BlockPool

_NO_IDS = BlockIds(())


class BlockTables:
    def __init__(self) -> None:
        self._tables: dict[str, list[Block]] = {}
        self._ids: dict[str, tuple[list[Block], BlockIds]] = {}
        """`ids` as last made, with the list it was made from."""

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tables

    def __getitem__(self, request_id: str) -> list[Block]:
        return self._tables[request_id]

    def get(self, request_id: str) -> list[Block] | None:
        return self._tables.get(request_id)

    def table(self, request_id: str) -> list[Block]:
        """The request's table, made empty on its first allocation."""
        return self._tables.setdefault(request_id, [])

    def pop(self, request_id: str) -> list[Block] | None:
        self._ids.pop(request_id, None)
        return self._tables.pop(request_id, None)

    def items(self) -> ItemsView[str, list[Block]]:
        return self._tables.items()

    def request_ids(self) -> set[str]:
        return set(self._tables)

    def ids(self, request_id: str) -> BlockIds:
        """The request's block table as ids."""
        table = self._tables.get(request_id)
        if table is None:
            return _NO_IDS
        known = self._ids.get(request_id)
        if known is not None and known[0] is table and len(known[1]) <= len(table):
            if len(known[1]) == len(table):
                return known[1]
            ids = known[1].extend(b.block_id for b in table[len(known[1]) :])  # it grew
        else:
            ids = BlockIds(b.block_id for b in table)
        self._ids[request_id] = (table, ids)
        return ids

    def check_integrity(self) -> None:
        """Ids are kept only for live tables, and match them."""
        for rid, (table, ids) in self._ids.items():
            assert self._tables.get(rid) is table, f"{rid}: block ids kept for a freed table"
            assert ids == tuple(b.block_id for b in table[: len(ids)]), f"{rid}: stale block ids"


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
