"""Moving KV between the device pool and the lower tiers (host RAM, then disk), from the event loop.

A prompt's longest cached prefix is found tier by tier: device blocks first, then the host tier
for the blocks after them, then the disk tier for the blocks after the host hit. The host and disk
parts are copied into reserved device blocks and registered, so admission hits them; blocks read
from disk are also kept in the host tier. After each step, newly registered blocks are offered to
both tiers (write-behind).

Nothing blocks the loop: LMDB reads run on worker threads, segment files are read through
aiofiles (`DiskTier.load_async`); KV tensor copies (and the host
tier's payload copies) on the executor the engine passes in. Fills write only reserved blocks, which
no step can see until they are committed; snapshots pin the blocks they read, so a step of the
other worker cannot reuse them meanwhile. Host-tier lookups are dictionary probes under a lock, done on
the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.disk.tier import DiskTier
from deepinfer.config import Retention
from deepinfer.engine.core import EngineCore
from deepinfer.engine.tier_windows import fill_window_from_disk, write_windows_behind
from deepinfer.errors import InvalidRequestError
from deepinfer.request import Request
from deepinfer.runner.host_kv import write_blocks_from_views

log = logging.getLogger("deepinfer.engine")

NewBlock = tuple[int, BlockHash, str | None]
"""(device block id, hash, retention class), as drained from the cache manager."""


def check_retention(retention: str | None) -> None:
    if retention is not None and retention not in tuple(Retention):
        raise InvalidRequestError(
            f"cache_retention must be one of {', '.join(Retention)}, got {retention!r}",
            param="cache_retention",
        )


@dataclass(frozen=True)
class TierFill:
    """Prompt tokens copied into device blocks on submit, by the tier they came from."""

    host_tokens: int = 0
    disk_tokens: int = 0


@dataclass(frozen=True)
class _FillPlan:
    block_ids: list[int]
    host_hashes: list[BlockHash]
    disk_hashes: list[BlockHash]
    disk_payloads: list[bytes]
    retention: str | None


async def fill_from_lower_tiers(core: EngineCore, forward: Executor, request: Request) -> TierFill:
    """Load the prompt's leading blocks that are in the host or disk tier but not on the device
    into free device blocks, registered under their hashes, so admission hits them; with a
    windowed pool, then a window from the disk tier where the hit would replay."""
    kv, host, disk = core.kv, core.host, core.disk
    if (host is None and disk is None) or not kv.enable_prefix_caching:
        return TierFill()
    if request.retention == Retention.NONE:
        return TierFill()
    hashes = kv.tiers.prompt_hashes(request)
    fill = await _fill_blocks_from_tiers(core, forward, request, hashes)
    await fill_window_from_disk(core, forward, hashes)
    return fill


async def _fill_blocks_from_tiers(
    core: EngineCore, forward: Executor, request: Request, hashes: list[BlockHash]
) -> TierFill:
    kv, host, disk = core.kv, core.host, core.disk
    num_device = kv.tiers.cached_prefix_len(hashes)
    rest = hashes[num_device:]
    num_host = host.contains_prefix(rest) if host is not None else 0
    num_disk = 0
    if disk is not None and num_host < len(rest):
        num_disk = await _disk_prefix(disk, rest[num_host:])
    reservation = kv.tiers.reserve(num_host + num_disk) if num_host + num_disk else None
    if reservation is None:
        _touch(core, hashes[:num_device], request.retention)
        return TierFill()
    reservation_id, block_ids = reservation
    loaded = (0, 0)
    try:
        disk_hashes = rest[num_host : num_host + num_disk]
        payloads: list[bytes | None] = []
        if disk is not None and disk_hashes:
            payloads = await _disk_load(disk, disk_hashes)
        plan = _FillPlan(
            block_ids, rest[:num_host], disk_hashes, _leading(payloads), request.retention
        )
        loop = asyncio.get_running_loop()
        loaded = await loop.run_in_executor(forward, _fill_blocks, core, plan)
    finally:
        kv.tiers.commit(reservation_id, rest[: sum(loaded)])
    _touch(core, hashes[: num_device + sum(loaded)], request.retention)
    return TierFill(loaded[0] * kv.block_size, loaded[1] * kv.block_size)


async def _disk_prefix(disk: DiskTier, hashes: list[BlockHash]) -> int:
    """The disk tier's prefix hit; 0 if it fails (it should not: it degrades instead)."""
    try:
        return await asyncio.to_thread(disk.contains_prefix, hashes)
    except Exception:
        log.exception("disk tier lookup failed; serving without it")
        return 0


async def _disk_load(disk: DiskTier, hashes: list[BlockHash]) -> list[bytes | None]:
    """Verified payloads from the disk tier; all misses if it fails."""
    try:
        return await disk.load_async(hashes)
    except Exception:
        log.exception("disk tier read failed; serving without it")
        return [None] * len(hashes)


def _leading(payloads: Sequence[bytes | None]) -> list[bytes]:
    """The payloads before the first miss (a prefix hit cannot skip a block)."""
    out = []
    for payload in payloads:
        if payload is None:
            break
        out.append(payload)
    return out


def _fill_blocks(core: EngineCore, plan: _FillPlan) -> tuple[int, int]:
    """On the KV-copy thread: copy host slots, then disk payloads, into the reserved blocks;
    keep the disk payloads in the host tier. Returns (host blocks, disk blocks) filled, a prefix
    of the plan (a host entry evicted since the lookup ends it)."""
    host, ids = core.host, plan.block_ids
    views = host.lease(plan.host_hashes) if host is not None and plan.host_hashes else []
    try:
        write_blocks_from_views(core.kv_caches, ids[: len(views)], views)
    finally:
        if host is not None and views:
            host.release(plan.host_hashes[: len(views)])
    if len(views) < len(plan.host_hashes) or not plan.disk_payloads:
        return len(views), 0
    num_disk = len(plan.disk_payloads)
    try:
        core.fill_blocks(ids[len(views) : len(views) + num_disk], plan.disk_payloads)
    except Exception:  # payloads that do not fit the pool: the disk hit is lost, not the request
        log.exception("copying disk tier blocks into the KV pool failed; recomputing them")
        return len(views), 0
    if host is not None:
        for block_hash, payload in zip(plan.disk_hashes, plan.disk_payloads, strict=False):
            host.offer(block_hash, payload, plan.retention)
    return len(views), num_disk


def _touch(core: EngineCore, served: list[BlockHash], retention: str | None) -> None:
    """Hits served (from any tier) refresh the copies in the lower tiers."""
    if not served:
        return
    if core.host is not None:
        core.host.touch(served)
    if core.disk is not None:
        try:
            core.disk.touch(served, retention)
        except Exception:
            log.exception("disk tier touch failed")


async def write_behind(core: EngineCore, forward: Executor) -> None:
    """Offer blocks registered in the last step to the host and disk tiers: a snapshot copy (and
    the host tier's copy) on the forward thread now; the disk write happens on the disk tier's
    writer thread, or is dropped."""
    await write_windows_behind(core, forward)
    new = [b for b in core.kv.drain_new_blocks() if b[2] != Retention.NONE]
    if not new or (core.disk is None and core.host is None):
        return
    loop = asyncio.get_running_loop()
    pin = core.kv.tiers.pin([b[0] for b in new])  # the other worker's steps may reuse freed ones
    try:
        payloads = await loop.run_in_executor(forward, _snapshot_to_host, core, new)
    finally:
        core.kv.tiers.unpin(pin)
    core.offer_to_disk([(b[1], b[2]) for b in new], payloads)


def _snapshot_to_host(core: EngineCore, new: list[NewBlock]) -> list[bytes]:
    payloads = core.snapshot_blocks([b[0] for b in new])
    if core.host is not None:
        for (_, block_hash, retention), payload in zip(new, payloads, strict=True):
            core.host.offer(block_hash, payload, retention)
    return payloads
