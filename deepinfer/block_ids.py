"""`BlockIds`: a request's block table as the scheduler hands it to the runner."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence


class BlockIds(tuple[int, ...]):
    """A request's block ids: a tuple to every reader, made once each time its table grows,
    that carries the same ids as native int32 bytes (`int32`). A step's `[B, max_blocks]` table
    is then one join of byte rows, not a conversion of every id of every row at every step
    (which grows with the context: 4 ms a step for 256 rows of 4k tokens)."""

    int32: bytes

    def __new__(cls, ids: Iterable[int]) -> BlockIds:
        self = super().__new__(cls, ids)
        self.int32 = array("i", self).tobytes()
        return self

    def extend(self, more: Iterable[int]) -> BlockIds:
        """These ids then `more` (a table that grew: its bytes are copied, not converted)."""
        tail = tuple(more)
        grown = tuple.__new__(BlockIds, self + tail)
        grown.int32 = self.int32 + array("i", tail).tobytes()
        return grown


def int32_row(ids: Sequence[int]) -> bytes:
    """Block ids as native int32 bytes (those of a `BlockIds` as made)."""
    return ids.int32 if isinstance(ids, BlockIds) else array("i", ids).tobytes()
