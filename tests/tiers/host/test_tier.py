"""HostTier: LRU order, byte-budget eviction, leases, counters, the slot arena, and integrity
checked after every operation (including a randomized run against a reference LRU)."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from deepinfer.cache.free_queue import IntegrityError
from deepinfer.tiers.host import HostTier, SlotArena

SIZE = 64


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def payload(i: int, size: int = SIZE) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(size))


def tier(num_slots: int, size: int = SIZE) -> HostTier:
    t = HostTier(size, num_slots * size + size // 2)  # the half slot is rounded away
    assert t.num_slots == num_slots
    return t


def offer(t: HostTier, *keys: int) -> None:
    for k in keys:
        assert t.offer(h(k), payload(k))
        t.check_integrity()


def test_lru_order_follows_use() -> None:
    t = tier(3)
    offer(t, 1, 2, 3)
    assert t.lru_hashes() == [h(1), h(2), h(3)]
    assert t.load([h(1)]) == [payload(1)]  # a hit: 1 becomes most recent
    t.check_integrity()
    t.touch([h(2), h(99)])  # a hit served by another tier; unknown hashes are ignored
    t.check_integrity()
    assert t.lru_hashes() == [h(3), h(1), h(2)]
    offer(t, 1)  # re-offering a held block refreshes it, stores nothing new
    assert t.lru_hashes() == [h(3), h(2), h(1)]
    offer(t, 4)
    assert t.lru_hashes() == [h(2), h(1), h(4)]
    assert t.load([h(3)]) == [None]
    s = t.stats()
    assert (s.num_offers, s.num_evictions, s.num_blocks) == (4, 1, 3)


def test_byte_budget_evicts_least_recent() -> None:
    t = tier(4)
    offer(t, *range(10))
    s = t.stats()
    assert s.num_blocks == 4 and s.num_bytes == 4 * SIZE == s.capacity_bytes
    assert s.num_evictions == 6
    assert t.lru_hashes() == [h(k) for k in range(6, 10)]
    assert t.load([h(k) for k in range(10)]) == [None] * 6 + [payload(k) for k in range(6, 10)]
    t.check_integrity()
    s = t.stats()
    assert (s.num_lookups, s.num_hits) == (10, 4)


def test_contains_prefix_stops_at_first_miss() -> None:
    t = tier(8)
    offer(t, 1, 2, 4)
    assert t.contains_prefix([h(1), h(2), h(3), h(4)]) == 2
    assert t.contains_prefix([h(3), h(1)]) == 0
    assert t.contains_prefix([]) == 0
    assert t.stats().num_lookups == 0  # probes are not loads


def test_leases_share_bytes_and_block_eviction() -> None:
    t = tier(2)
    offer(t, 1, 2)
    views = t.lease([h(1), h(2), h(3), h(1)])  # the held prefix only
    t.check_integrity()
    assert [bytes(v) for v in views] == [payload(1), payload(2)]
    assert not t.offer(h(3), payload(3)), "every slot is leased: the offer is dropped"
    assert t.stats().num_offers_dropped == 1
    t.release([h(1)])
    t.check_integrity()
    offer(t, 3)  # evicts 1 (released), not 2 (still leased)
    assert t.lru_hashes() == [h(2), h(3)]
    assert bytes(views[1]) == payload(2), "a leased slot is never overwritten"
    t.release([h(2)])
    t.check_integrity()
    offer(t, 4)
    assert t.lru_hashes() == [h(3), h(4)]


def test_retention_none_and_bad_input() -> None:
    t = tier(2)
    assert not t.offer(h(1), payload(1), "none")
    assert t.offer(h(2), payload(2), "agent")
    assert t.lru_hashes() == [h(2)]
    with pytest.raises(ValueError, match="64 bytes"):
        t.offer(h(3), payload(3, SIZE - 1))
    t.check_integrity()
    with pytest.raises(ValueError, match="at least one block"):
        HostTier(SIZE, SIZE - 1)
    assert t.offer(h(4), memoryview(bytearray(payload(4))))  # any bytes-like payload
    assert t.load([h(4)]) == [payload(4)]


def test_integrity_catches_a_shared_slot() -> None:
    t = tier(3)
    offer(t, 1, 2)
    t._entries[h(2)].slot = t._entries[h(1)].slot
    with pytest.raises(IntegrityError):
        t.check_integrity()


def test_arena_chunks_are_lazy_disjoint_and_preallocatable() -> None:
    sizes: list[int] = []

    def allocate(n: int) -> memoryview:
        sizes.append(n)
        return memoryview(bytearray(n))

    arena = SlotArena(10, 7, allocate, chunk_bytes=32)  # 3 slots per chunk: 3 + 3 + 1
    assert sizes == [] and arena.allocated_bytes == 0
    for slot in range(7):
        arena.view(slot)[:] = bytes([slot]) * 10
    assert sizes == [30, 30, 10]
    assert [bytes(arena.view(s)) for s in range(7)] == [bytes([s]) * 10 for s in range(7)]
    sizes.clear()
    SlotArena(10, 7, allocate, chunk_bytes=32, preallocate=True)
    assert sizes == [30, 30, 10]
    with pytest.raises(ValueError, match="bad buffer"):
        SlotArena(10, 1, lambda n: memoryview(bytes(n)), preallocate=True)  # read-only


def test_tier_uses_the_given_allocator_up_front() -> None:
    sizes: list[int] = []

    def allocate(n: int) -> memoryview:
        sizes.append(n)
        return memoryview(bytearray(n))

    t = HostTier(SIZE, 5 * SIZE, allocate, preallocate=True)
    assert sum(sizes) == 5 * SIZE
    offer(t, 1)
    assert len(sizes) == 1


def test_randomized_against_reference_lru() -> None:
    rng = random.Random(0)
    capacity = 6
    t = tier(capacity)
    ref: OrderedDict[int, bytes] = OrderedDict()
    for _ in range(3000):
        k = rng.randrange(15)
        op = rng.random()
        if op < 0.4:
            retention = rng.choice([None, "chat", "none"])
            stored = t.offer(h(k), payload(k), retention)
            assert stored == (retention != "none")
            if stored:
                if k not in ref and len(ref) == capacity:
                    ref.popitem(last=False)
                ref[k] = payload(k)
                ref.move_to_end(k)
        elif op < 0.6:
            assert t.load([h(k)]) == [ref.get(k)]
            if k in ref:
                ref.move_to_end(k)
        elif op < 0.7:
            t.touch([h(k)])
            if k in ref:
                ref.move_to_end(k)
        elif op < 0.85:
            keys = [rng.randrange(15) for _ in range(4)]
            expected = 0
            while expected < len(keys) and keys[expected] in ref:
                expected += 1
            assert t.contains_prefix([h(x) for x in keys]) == expected
        else:
            keys = [rng.randrange(15) for _ in range(3)]
            views = t.lease([h(x) for x in keys])
            leased = keys[: len(views)]
            assert [bytes(v) for v in views] == [ref[x] for x in leased]
            for x in leased:
                ref.move_to_end(x)
            t.release([h(x) for x in leased])
        t.check_integrity()
        assert t.lru_hashes() == [h(x) for x in ref]
    s = t.stats()
    assert s.num_blocks == len(ref) and s.num_evictions > 0 and s.num_hits > 0
