"""BlockPool: LRU order, reference counting, the hash map, and integrity checking; a table's ids."""

from __future__ import annotations

import random

import pytest

from deepinfer.block_ids import BlockIds
from deepinfer.cache.block_pool import NULL_BLOCK_ID, BlockPool
from deepinfer.cache.block_tables import BlockTables
from deepinfer.cache.free_queue import Block, FreeBlockQueue, IntegrityError


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(5)
    assert pool.num_usable_blocks == pool.num_free_blocks == 4
    blocks = pool.allocate(4)
    assert NULL_BLOCK_ID not in {b.block_id for b in blocks}
    assert pool.num_free_blocks == 0
    pool.check_integrity()
    with pytest.raises(ValueError):
        BlockPool(1)


def test_free_order_tail_first_and_unhashed_first() -> None:
    pool = BlockPool(9)
    a = pool.allocate(4)  # ids 1..4
    for block, i in zip(a[:3], range(3), strict=True):
        assert pool.cache_block(block, h(i))
    pool.free(a)  # block 4 has no hash: reused first; then 3, 2, 1 (tail before head)
    pool.check_integrity()
    order = [b.block_id for b in pool.allocate(8)]
    assert order == [4, 5, 6, 7, 8, 3, 2, 1]
    assert pool.num_cached_blocks == 0 and pool.num_evictions == 3
    pool.check_integrity()


def test_freed_cached_block_hits_until_evicted() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.cache_block(b, h(7))
    pool.free([b])
    assert pool.get_cached_block(h(7)) is b and pool.num_free_blocks == 3
    pool.touch([b])  # a hit on a free block takes it out of the free queue
    assert b.ref_count == 1 and pool.num_free_blocks == 2
    pool.touch([b])
    assert b.ref_count == 2
    pool.free([b])
    pool.free([b])
    pool.check_integrity()
    pool.allocate(2)
    assert pool.get_cached_block(h(7)) is b  # the two never-used blocks went first
    pool.allocate(1)
    assert pool.get_cached_block(h(7)) is None and b.block_hash is None
    pool.check_integrity()


def test_fresh_blocks_go_out_in_id_order_after_unhashed_ones() -> None:
    """Where the KV tensors are reserved but untouched until written, this order keeps the
    written part of the pool compact: reused blocks first, then never-used ones, lowest first."""
    pool = BlockPool(10)
    assert [b.block_id for b in pool.allocate(3)] == [1, 2, 3]
    pool.free(pool.allocate(2))  # 4 and 5, unhashed: reused before 6
    assert [b.block_id for b in pool.allocate(4)] == [4, 5, 6, 7]
    pool.check_integrity()


def test_reset_prefix_cache_moves_dropped_blocks_to_the_head() -> None:
    pool = BlockPool(9)
    a = pool.allocate(3)  # ids 1..3
    for i, block in enumerate(a):
        pool.cache_block(block, h(i))
    pool.free(a)  # queue: 4..8, then 3, 2, 1
    assert pool.reset_prefix_cache() == 3
    pool.check_integrity()
    assert pool.num_cached_blocks == 0
    assert pool.free_block_ids() == [3, 2, 1, 4, 5, 6, 7, 8]


def test_duplicate_content_keeps_first_block() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, h(1))
    assert not pool.cache_block(b, h(1))
    assert pool.get_cached_block(h(1)) is a and b.block_hash is None
    pool.check_integrity()


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(4, enable_caching=False)
    (b,) = pool.allocate(1)
    assert not pool.cache_block(b, h(1))
    assert pool.get_cached_block(h(1)) is None
    pool.check_integrity()


def test_integrity_catches_corruption() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    b.ref_count = 0  # in use per the queue, free per the count
    with pytest.raises(IntegrityError):
        pool.check_integrity()
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    b.block_hash = h(3)  # hash not in the map
    with pytest.raises(IntegrityError):
        pool.check_integrity()
    pool = BlockPool(4)
    pool.null_block.ref_count = 1
    with pytest.raises(IntegrityError):
        pool.check_integrity()


def test_free_queue_links() -> None:
    q = FreeBlockQueue()
    blocks = [Block(i) for i in range(5)]
    for b in blocks:
        q.append(b)
    q.remove(blocks[2])
    q.append_left(blocks[2])
    assert [b.block_id for b in q] == [2, 0, 1, 3, 4]
    assert q.pop_left() is blocks[2] and blocks[2] not in q
    q.check_integrity()
    assert len(q) == 4


def test_random_operations_against_a_model() -> None:
    """Random allocate/touch/free/cache against a plain-Python model of ref counts and LRU."""
    rng = random.Random(0)
    pool = BlockPool(17)
    held: list[list[Block]] = []
    lru: list[int] = list(range(1, 17))  # model of the free queue, head first
    for step in range(3000):
        op = rng.random()
        if op < 0.4 and pool.num_free_blocks:
            n = rng.randint(1, pool.num_free_blocks)
            got = pool.allocate(n)
            assert [b.block_id for b in got] == lru[:n]
            del lru[:n]
            for b in got:
                if rng.random() < 0.5:
                    pool.cache_block(b, h(step * 100 + b.block_id))
            held.append(got)
        elif op < 0.6 and held:
            table = rng.choice(held)
            cached = [b for b in table if b.block_hash is not None]
            if cached:
                hit = pool.get_cached_block(rng.choice(cached).block_hash or b"")
                assert hit is not None
                pool.touch([hit])
                held.append([hit])
                if hit.block_id in lru:
                    lru.remove(hit.block_id)
        elif held:
            table = held.pop(rng.randrange(len(held)))
            pool.free(table)
            for b in reversed(table):
                if b.ref_count == 0:
                    if b.block_hash is None:
                        lru.insert(0, b.block_id)
                    else:
                        lru.append(b.block_id)
        pool.check_integrity()
        assert pool.free_block_ids() == lru


def test_block_ids_follow_a_growing_table() -> None:
    """A table's ids are made once and extended as it grows: equal to the table's ids made
    afresh, as a tuple and as int32 bytes."""
    pool, tables = BlockPool(40), BlockTables()
    assert tables.ids("r") == ()
    table = tables.table("r")
    for n in (1, 3, 0, 7, 2):
        table.extend(pool.allocate(n))
        ids = tables.ids("r")
        assert ids == tuple(b.block_id for b in table) and tables.ids("r") is ids
        assert ids.int32 == BlockIds(ids).int32
    tables.check_integrity()
    tables.pop("r")
    assert tables.ids("r") == ()
