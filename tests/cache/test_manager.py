"""KVCacheManager: prefix hits, all-or-nothing allocation, registration after compute, freeing."""

from __future__ import annotations

from deepinfer.cache.block_hash import block_hashes_for, seed_bytes
from deepinfer.cache.manager import KVCacheManager
from deepinfer.request import Request, SamplingParams


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def compute(kv: KVCacheManager, r: Request, num_new: int) -> None:
    """What the scheduler does around one step for `r`: allocate, 'compute', register."""
    hits, num_hit = kv.get_computed_blocks(r) if r.num_computed_tokens == 0 else ([], 0)
    assert kv.allocate_slots(r, num_new, hits)
    r.num_computed_tokens = num_hit + r.num_computed_tokens + num_new
    kv.cache_blocks(r)
    kv.check_integrity()


def test_hit_is_capped_below_the_whole_prompt() -> None:
    kv = KVCacheManager(32, 4, "fp")
    a = req("a", list(range(16)))
    compute(kv, a, 16)
    assert kv.num_cached_blocks == 4
    for n, want in [(16, 12), (17, 16), (3, 0), (4, 0), (5, 4)]:
        blocks, num_hit = kv.get_computed_blocks(req(f"q{n}", list(range(n))))
        assert num_hit == want and len(blocks) * 4 == want
        assert [b.block_id for b in blocks] == list(kv.block_ids("a")[: want // 4])


def test_hashes_are_the_documented_chain() -> None:
    kv = KVCacheManager(32, 4, "fp")
    a = req("a", list(range(10)), salt="s")
    compute(kv, a, 10)
    want = block_hashes_for(list(range(10)), 4, seed_bytes("fp"), "s")
    assert kv.block_hashes(a) == want
    table = [kv.pool.blocks[i] for i in kv.block_ids("a")]
    assert [b.block_hash for b in table] == [*want, None]


def test_registration_waits_for_computation() -> None:
    kv = KVCacheManager(32, 4, "fp")
    a = req("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    assert kv.num_cached_blocks == 0  # allocated, not computed: nobody may hit it yet
    assert kv.get_computed_blocks(req("b", list(range(12))))[1] == 0
    a.num_computed_tokens = 6
    kv.cache_blocks(a)
    assert kv.num_cached_blocks == 1
    a.num_computed_tokens = 12
    kv.cache_blocks(a)
    assert kv.num_cached_blocks == 3
    kv.check_integrity()


def test_allocation_is_all_or_nothing_and_counts_free_hits() -> None:
    kv = KVCacheManager(6, 4, "fp")  # 5 usable blocks
    a = req("a", list(range(13)))
    compute(kv, a, 13)  # 4 blocks, 3 cached
    kv.free(a)
    assert kv.num_free_blocks == 5 and kv.num_used_blocks == 0
    # Same 12-token prefix plus 9 new tokens: 3 hits (free, cached) + 3 new blocks = 6 > 5.
    b = req("b", [*range(12), *range(100, 109)])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12
    assert not kv.can_allocate(b, 9, hits) and not kv.allocate_slots(b, 9, hits)
    assert kv.num_free_blocks == 5 and kv.block_ids("b") == ()
    kv.check_integrity()
    assert kv.allocate_slots(b, 8, hits)  # 3 hits + 2 new
    assert kv.num_free_blocks == 0 and kv.block_ids("b")[:3] == tuple(blk.block_id for blk in hits)
    kv.check_integrity()


def test_shared_blocks_are_reference_counted() -> None:
    kv = KVCacheManager(16, 4, "fp")
    a, b = req("a", list(range(9))), req("b", list(range(9)))
    compute(kv, a, 9)
    compute(kv, b, 1)
    assert kv.block_ids("a")[:2] == kv.block_ids("b")[:2]
    assert kv.block_ids("a")[2] != kv.block_ids("b")[2]
    assert kv.num_used_blocks == 4
    kv.free(a)
    assert kv.num_used_blocks == 3
    kv.free(a)  # idempotent
    kv.free(b)
    assert kv.num_used_blocks == 0 and kv.num_cached_blocks == 2
    kv.check_integrity()


def test_decode_growth_registers_generated_blocks() -> None:
    kv = KVCacheManager(16, 4, "fp")
    a = req("a", list(range(3)))
    compute(kv, a, 3)
    for t in range(6):  # generate 6 tokens, computing each but the last
        a.output_token_ids.append(50 + t)
        if t < 5:
            compute(kv, a, 1)
    assert a.num_computed_tokens == 8 and kv.num_cached_blocks == 2
    follow_up = req("b", [*range(3), *range(50, 56), 99])
    assert kv.get_computed_blocks(follow_up)[1] == 8


def test_usage_and_hit_counters() -> None:
    kv = KVCacheManager(16, 4, "fp")
    compute(kv, req("a", list(range(9))), 9)
    compute(kv, req("b", list(range(9))), 1)
    u = kv.usage()
    assert (u.num_total_blocks, u.num_used_blocks, u.num_free_blocks) == (15, 4, 11)
    assert (u.num_cached_blocks, u.num_query_tokens, u.num_hit_tokens) == (2, 18, 8)


def test_prefix_caching_off() -> None:
    kv = KVCacheManager(16, 4, "fp", enable_prefix_caching=False)
    compute(kv, req("a", list(range(9))), 9)
    assert kv.get_computed_blocks(req("b", list(range(9)))) == ([], 0)
    assert kv.num_cached_blocks == 0


def test_reset_prefix_cache_keeps_in_use_blocks() -> None:
    kv = KVCacheManager(16, 4, "fp")
    a, b = req("a", list(range(9))), req("b", list(range(100, 109)))
    compute(kv, a, 9)
    compute(kv, b, 9)
    kv.free(a)
    assert kv.reset_prefix_cache() == 2
    assert kv.get_computed_blocks(req("c", list(range(9))))[1] == 0
    assert kv.get_computed_blocks(req("d", list(range(100, 109))))[1] == 8
    kv.check_integrity()


def test_new_blocks_are_recorded_only_when_tracked() -> None:
    untracked, tracked = (
        KVCacheManager(16, 4, "fp"),
        KVCacheManager(16, 4, "fp", track_new_blocks=True),
    )
    for kv in (untracked, tracked):
        compute(kv, req("a", list(range(9))), 9)
    assert untracked.drain_new_blocks() == []
    drained = tracked.drain_new_blocks()
    assert [block_id for block_id, _, _ in drained] == list(tracked.block_ids("a")[:2])
    assert tracked.drain_new_blocks() == []
