"""`KVTiers` over a small CPU pool and a host tier: write-behind offers the blocks a step
registered, and a later prompt whose device blocks were forgotten is filled from the host tier
into reserved blocks that admission then hits, with the same KV."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deepinfer.cache.manager import KVCacheManager
from deepinfer.config import Retention
from deepinfer.model.kv_layout import KVCaches
from deepinfer.request import Request, SamplingParams
from deepinfer.tiers.copies import TierCopies, block_payload_bytes, read_blocks
from deepinfer.tiers.host.tier import HostTier
from deepinfer.tiers.kv_tiers import KVTiers, TierFill

BLOCK, NUM_BLOCKS = 4, 16
PROMPT = list(range(100, 113))  # three full blocks a hit may cover, and a tail


@pytest.fixture
def forward() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=1) as executor:
        yield executor


def _caches() -> KVCaches:
    gen = torch.Generator().manual_seed(0)
    shape = (NUM_BLOCKS, BLOCK, 2, 8)  # [N, S, H, D]
    return [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in "ab"]


def _request(rid: str, retention: str | None = None) -> Request:
    return Request(rid, PROMPT, SamplingParams(max_tokens=4), retention=retention)


def _compute(kv: KVCacheManager, request: Request) -> list[int]:
    """Admit and 'compute' the whole prompt; the ids of its blocks."""
    hits, num_hit = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit
    assert kv.allocate_slots(request, num_new, hits)
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)
    kv.check_integrity()
    return list(kv.block_ids(request.request_id))


def _tiers(caches: KVCaches) -> tuple[KVCacheManager, KVTiers]:
    kv = KVCacheManager(NUM_BLOCKS, BLOCK, "fp", track_new_blocks=True)
    host = HostTier(block_payload_bytes(caches), 32 * block_payload_bytes(caches))
    return kv, KVTiers(kv, host, None, TierCopies(caches, []))


async def test_write_behind_then_fill_from_the_host_tier(forward: ThreadPoolExecutor) -> None:
    caches = _caches()
    kv, tiers = _tiers(caches)
    a = _request("a")
    ids = _compute(kv, a)[:3]
    expected = read_blocks(caches, ids)
    await tiers.write_behind(forward)
    host = tiers.host_stats()
    assert host is not None and host.num_blocks == 3 and tiers.disk_stats() is None
    kv.free(a)
    kv.reset_prefix_cache()  # the device forgets; the KV is overwritten below
    for k, v in caches:
        k.zero_()
        v.zero_()

    b = _request("b")
    assert await tiers.fill(b, forward) == TierFill(host_tokens=3 * BLOCK)
    kv.check_integrity()
    tiers.check_integrity()
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 3 * BLOCK
    assert read_blocks(caches, [h.block_id for h in hits]) == expected


async def test_retention_none_and_no_tier_fill_nothing(forward: ThreadPoolExecutor) -> None:
    caches = _caches()
    kv, tiers = _tiers(caches)
    _compute(kv, _request("a"))
    await tiers.write_behind(forward)
    kv.reset_prefix_cache()
    assert await tiers.fill(_request("b", Retention.NONE), forward) == TierFill()
    bare = KVTiers(kv, None, None, TierCopies(caches, []))
    assert await bare.fill(_request("c"), forward) == TierFill()
    await bare.write_behind(forward)
    assert bare.host_stats() is None and await bare.disk_summary() is None
    bare.close()
