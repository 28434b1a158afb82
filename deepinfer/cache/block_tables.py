"""`BlockTables`: each running request's block table.

A request's table is an append-only list of blocks (a freed request's list is dropped, never
reused), so its ids are made again only when it grows: a decode step asks for every running
request's ids and almost never finds a new block.
"""

from __future__ import annotations

from collections.abc import ItemsView

from deepinfer.block_ids import BlockIds
from deepinfer.cache.block_pool import Block

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
