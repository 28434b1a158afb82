"""`Block` and the O(1) doubly-linked free queue that orders blocks for eviction (LRU)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from deepinfer.cache.block_hash import BlockHash


class IntegrityError(AssertionError):
    """A cache or scheduler invariant does not hold (raised by `check_integrity`, even under -O)."""


def require(cond: bool, message: str) -> None:
    """`check_integrity` helper: unlike `assert`, never stripped by `python -O`."""
    if not cond:
        raise IntegrityError(message)


@dataclass(eq=False, slots=True)
class Block:
    """One KV block of the device pool. Identity is the object (and `block_id`).

    `block_hash` is set once the block is full and its KV computed; it stays set while the block
    sits in the free queue (the content is still there and can be hit) and is dropped only when
    the block is evicted for reuse.
    """

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Blocks with `ref_count == 0`, the head evicted first.

    Links live in the blocks themselves (`prev_free`/`next_free`) between two sentinels, so
    appending, popping the head and removing from the middle (a prefix-cache hit on a free block)
    are all O(1). A block is in the queue exactly when its `prev_free` is set.
    """

    def __init__(self) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_blocks = 0

    def __len__(self) -> int:
        return self.num_blocks

    def __contains__(self, block: Block) -> bool:
        return block.prev_free is not None

    def append(self, block: Block) -> None:
        """Enqueue at the tail: evicted last."""
        self._link(block, self._tail.prev_free, self._tail)

    def append_left(self, block: Block) -> None:
        """Enqueue at the head: evicted next (blocks whose content nobody can hit)."""
        self._link(block, self._head, self._head.next_free)

    def pop_left(self) -> Block:
        block = self._head.next_free
        assert block is not None and block is not self._tail, "pop from an empty free queue"
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_blocks -= 1

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def _link(self, block: Block, prev: Block | None, nxt: Block | None) -> None:
        assert block.prev_free is None and block.next_free is None, "block already queued"
        assert prev is not None and nxt is not None
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_blocks += 1

    def check_integrity(self) -> None:
        """Links are symmetric and the count matches a forward walk."""
        count = 0
        node = self._head
        while node.next_free is not None:
            nxt = node.next_free
            require(nxt.prev_free is node, f"broken back link at block {nxt.block_id}")
            node = nxt
            count += 1
        require(node is self._tail, "free queue does not end at its tail sentinel")
        require(count - 1 == self.num_blocks, f"free queue count {self.num_blocks} != {count - 1}")
