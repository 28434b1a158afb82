"""`KVTiers`: the KV tiers below the device pool (host RAM, then disk), as the engine sees them.

The engine's builder makes one from the prefill pool's manager, the host tier, the disk tier and
the copies between the pool's blocks and payloads (`TierCopies`); the engine calls `fill` on
submit, `write_behind` after each step, and `host_stats`, `disk_stats`, `disk_summary`,
`check_integrity` and `close`; nothing else reaches into the tiers or the blocks they hold.

A prompt's longest cached prefix is found tier by tier: device blocks first, then the host tier
for the blocks after them, then the disk tier for the blocks after the host hit. The host and disk
parts are copied into reserved device blocks and registered, so admission hits them; blocks read
from disk are also kept in the host tier. After each step, newly registered blocks are offered to
both tiers (write-behind).

Nothing blocks the loop: LMDB reads run on worker threads, segment files are read through
aiofiles (`DiskTier.load_async`); KV tensor copies (and the host tier's payload copies) on the
executor the engine passes in. Fills write only reserved blocks, which no step can see until
they are committed; snapshots pin the blocks they read, so a step of the other worker cannot
reuse them meanwhile. Host-tier lookups are dictionary probes under a lock, done on the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.manager import KVCacheManager
from deepinfer.config import Retention
from deepinfer.errors import InvalidRequestError
from deepinfer.kv_events.publisher import KVEventPublisher
from deepinfer.kv_events.recorder import BlockOrigin
from deepinfer.request import Request
from deepinfer.tiers.copies import TierCopies
from deepinfer.tiers.device_blocks import TierBlocks
from deepinfer.tiers.disk.tier import DiskTier
from deepinfer.tiers.host.tier import HostTier
from deepinfer.tiers.stats import DiskSummary, DiskTierStats, HostTierStats
from deepinfer.tiers.windows import fill_window_from_disk, write_windows_behind

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
    disk_origins: list[BlockOrigin] | None = None
    """What the host tier's events carry for the disk blocks it keeps (events on)."""


class KVTiers:
    def __init__(
        self,
        kv: KVCacheManager,
        host: HostTier | None,
        disk: DiskTier | None,
        copies: TierCopies,
        events: KVEventPublisher | None = None,
    ) -> None:
        """The tiers under `kv` (the prefill pool's manager; either tier may be off), and the
        publisher of every tier's KV events (None: off); each tier records its own."""
        self._kv = kv
        self.events = events
        self._blocks = TierBlocks(kv)
        self.host = host
        self.disk = disk
        self.copies = copies

    async def fill(self, request: Request, forward: Executor) -> TierFill:
        """Load the prompt's leading blocks that are in the host or disk tier but not on the
        device into free device blocks, registered under their hashes, so admission hits them;
        with a windowed pool, then a window from the disk tier where the hit would replay."""
        kv, host, disk = self._kv, self.host, self.disk
        if (host is None and disk is None) or not kv.enable_prefix_caching:
            return TierFill()
        if request.retention == Retention.NONE or request.needs_prompt_logits:
            return TierFill()  # nothing to keep, or no hit to serve
        hashes = self._blocks.prompt_hashes(request)
        fill = await self._fill_blocks_from_tiers(forward, request, hashes)
        await fill_window_from_disk(kv, self._blocks, disk, self.copies, forward, hashes)
        return fill

    async def _fill_blocks_from_tiers(
        self, forward: Executor, request: Request, hashes: list[BlockHash]
    ) -> TierFill:
        kv, host, disk = self._kv, self.host, self.disk
        num_device = self._blocks.cached_prefix_len(hashes)
        rest = hashes[num_device:]
        num_host = host.contains_prefix(rest) if host is not None else 0
        num_disk = 0
        if disk is not None and num_host < len(rest):
            num_disk = await _disk_prefix(disk, rest[num_host:])
        reservation = self._blocks.reserve(num_host + num_disk) if num_host + num_disk else None
        if reservation is None:
            self.touch(hashes[:num_device], request.retention)
            return TierFill()
        reservation_id, block_ids = reservation
        loaded = (0, 0)
        try:
            disk_hashes = rest[num_host : num_host + num_disk]
            payloads: list[bytes | None] = []
            if disk is not None and disk_hashes:
                payloads = await _disk_load(disk, disk_hashes)
            origins = None
            if host is not None and host.events is not None:
                start = num_device + num_host
                origins = [
                    _origin(request, hashes, start + j, kv.block_size)
                    for j in range(len(disk_hashes))
                ]
            plan = _FillPlan(
                block_ids,
                rest[:num_host],
                disk_hashes,
                _leading(payloads),
                request.retention,
                origins,
            )
            loop = asyncio.get_running_loop()
            loaded = await loop.run_in_executor(forward, self._fill_blocks, plan)
        finally:
            num_loaded = loaded[0] + loaded[1]
            self._blocks.commit(reservation_id, rest[:num_loaded])
            if kv.events is not None and num_loaded:
                indices = range(num_device, num_device + num_loaded)
                kv.publish_stored(request.token_span, hashes, indices)
        self.touch(hashes[: num_device + sum(loaded)], request.retention)
        return TierFill(loaded[0] * kv.block_size, loaded[1] * kv.block_size)

    def _fill_blocks(self, plan: _FillPlan) -> tuple[int, int]:
        """On the KV-copy thread: copy host slots, then disk payloads, into the reserved blocks;
        keep the disk payloads in the host tier. Returns (host blocks, disk blocks) filled, a
        prefix of the plan (a host entry evicted since the lookup ends it)."""
        host, ids = self.host, plan.block_ids
        views = host.lease(plan.host_hashes) if host is not None and plan.host_hashes else []
        try:
            self.copies.write_views(ids[: len(views)], views)
        finally:
            if host is not None and views:
                host.release(plan.host_hashes[: len(views)])
        if len(views) < len(plan.host_hashes) or not plan.disk_payloads:
            return len(views), 0
        num_disk = len(plan.disk_payloads)
        try:
            self.copies.write(ids[len(views) : len(views) + num_disk], plan.disk_payloads)
        except Exception:  # payloads that do not fit the pool: the hit is lost, not the request
            log.exception("copying disk tier blocks into the KV pool failed; recomputing them")
            return len(views), 0
        if host is not None:
            origins = plan.disk_origins
            for j, (block_hash, payload) in enumerate(
                zip(plan.disk_hashes, plan.disk_payloads, strict=False)
            ):
                host.offer(block_hash, payload, plan.retention, origins[j] if origins else None)
        return len(views), num_disk

    def touch(self, served: list[BlockHash], retention: str | None) -> None:
        """Hits served (from any tier) refresh the copies in the lower tiers."""
        if not served:
            return
        if self.host is not None:
            self.host.touch(served)
        if self.disk is not None:
            try:
                self.disk.touch(served, retention)
            except Exception:
                log.exception("disk tier touch failed")

    async def write_behind(self, forward: Executor) -> None:
        """Offer blocks registered in the last step to the host and disk tiers: a snapshot copy
        (and the host tier's copy) on the forward thread now; the disk write happens on the disk
        tier's writer thread, or is dropped."""
        if self.events is not None:
            self.events.end_step()
        await write_windows_behind(self._kv, self.disk, self.copies, forward)
        new = [b for b in self._kv.drain_new_blocks() if b[2] != Retention.NONE]
        origins = self._kv.drain_new_origins() if self.events is not None else {}
        if not new or (self.disk is None and self.host is None):
            return
        loop = asyncio.get_running_loop()
        pin = self._blocks.pin([b[0] for b in new])  # the other worker's steps may reuse freed ones
        try:
            payloads = await loop.run_in_executor(forward, self._snapshot_to_host, new, origins)
        finally:
            self._blocks.unpin(pin)
        if self.disk is not None:
            for (_, block_hash, retention), payload in zip(new, payloads, strict=True):
                origin = origins.get(block_hash)
                self.disk.offer(block_hash, payload, self._kv.block_size, retention, origin)

    def _snapshot_to_host(
        self, new: list[NewBlock], origins: dict[BlockHash, BlockOrigin]
    ) -> list[bytes]:
        payloads = self.copies.read([b[0] for b in new])
        if self.host is not None:
            for (_, block_hash, retention), payload in zip(new, payloads, strict=True):
                self.host.offer(block_hash, payload, retention, origins.get(block_hash))
        return payloads

    def kv_events_dropped(self) -> int | None:
        """KV events dropped since start (None: events off)."""
        return self.events.recorder.num_dropped if self.events is not None else None

    def host_stats(self) -> HostTierStats | None:
        return self.host.stats() if self.host is not None else None

    def disk_stats(self) -> DiskTierStats | None:
        return self.disk.stats() if self.disk is not None else None

    async def disk_summary(self) -> DiskSummary | None:
        """The disk tier's contents per retention class (a scan of its index, in a worker
        thread: call it now and then, not per request); None without a disk tier."""
        disk = self.disk
        return None if disk is None else await asyncio.to_thread(disk.summary)

    def check_integrity(self) -> None:
        if self.host is not None:
            self.host.check_integrity()

    def close(self) -> None:
        """Write what the disk tier has queued and stop its writer, then send the last KV
        events and stop their publisher (blocking)."""
        if self.disk is not None:
            self.disk.close()
        if self.events is not None:
            self.events.close()


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


def _origin(request: Request, hashes: list[BlockHash], index: int, block_size: int) -> BlockOrigin:
    """Block `index` of the request's prompt: its parent's hash and its tokens."""
    parent = hashes[index - 1] if index > 0 else None
    tokens = request.token_span(index * block_size, (index + 1) * block_size)
    return BlockOrigin(parent, tuple(tokens))


def _leading(payloads: Sequence[bytes | None]) -> list[bytes]:
    """The payloads before the first miss (a prefix hit cannot skip a block)."""
    out = []
    for payload in payloads:
        if payload is None:
            break
        out.append(payload)
    return out
