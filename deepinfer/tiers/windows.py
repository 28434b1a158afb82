"""A sliding-window model's windows in the disk tier: written where prompts end, read back on a
hit that would otherwise replay (see `cache/window_group.py`).

The host and disk tiers hold every cached block's full-layer KV. The windowed layers' KV is kept
on disk only for the window before each prompt's last full block boundary (where an agent's next
turn resumes), one record per block under `window_key(block hash)`. A later request whose hit
would replay its windowed layers (the windowed pool forgot that window: evicted, or the process
restarted) looks for such a window between the replay start and its hit's end; found, the
window is read into reserved blocks of the windowed pool and registered there, so admission
computes from that boundary exactly instead of replaying thousands of tokens.

Like the rest of the tiers: LMDB lookups on worker threads, segment reads through aiofiles, KV
copies on the executor the engine passes in; a window is read only into reserved blocks, and
snapshots pin the blocks they read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import Executor

from deepinfer.cache.block_hash import BlockHash, window_key
from deepinfer.cache.manager import KVCacheManager
from deepinfer.cache.window_group import WindowGroup, best_window_end
from deepinfer.config import Retention
from deepinfer.tiers.copies import TierCopies
from deepinfer.tiers.device_blocks import TierBlocks
from deepinfer.tiers.disk.tier import DiskTier

log = logging.getLogger("deepinfer.engine")


async def write_windows_behind(
    kv: KVCacheManager, disk: DiskTier | None, copies: TierCopies, forward: Executor
) -> None:
    """Offer the windows kept since the last step to the disk tier (snapshots on `forward`)."""
    window = kv.window
    if window is None:
        return
    new = [w for w in kv.drain_new_windows() if w[1] != Retention.NONE]
    if not new or disk is None:
        return
    blocks = {h: (block_id, retention) for window_blocks, retention in new
              for block_id, h in window_blocks}  # fmt: skip  # requests may share a window
    ids = [block_id for block_id, _ in blocks.values()]
    pin = window.pin(ids)  # the windows slide on: freed blocks may be reused meanwhile
    try:
        loop = asyncio.get_running_loop()
        payloads = await loop.run_in_executor(forward, copies.read_windows, ids)
    finally:
        window.unpin(pin)
    for (h, (_, retention)), payload in zip(blocks.items(), payloads, strict=True):
        disk.offer(window_key(h), payload, kv.block_size, retention)


async def fill_window_from_disk(
    kv: KVCacheManager,
    tier_blocks: TierBlocks,
    disk: DiskTier | None,
    copies: TierCopies,
    forward: Executor,
    hashes: Sequence[BlockHash],
) -> int:
    """Before admission: where the device's prefix hit (`hashes`' leading blocks on the device)
    would replay, the latest window on disk between the replay start and the hit's end, read into
    the windowed pool. Returns the boundary it serves (0: none)."""
    window = kv.window
    if window is None or disk is None:
        return 0
    num_hit = tier_blocks.cached_prefix_len(hashes)
    if num_hit == 0 or window.stored_window_end(hashes, num_hit) is not None:
        return 0
    end = await _window_on_disk(window, disk, hashes[:num_hit])
    if end is None:
        return 0
    first = window.spec.first_block_needed(end, window.block_size)
    wanted = list(hashes[first : end // window.block_size])
    ids = window.reserve(len(wanted))
    if ids is None:
        return 0
    filled: list[BlockHash] = []
    try:
        loaded = await disk.load_async([window_key(h) for h in wanted])
        payloads = [p for p in loaded if p is not None]
        if len(payloads) == len(wanted):
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(forward, copies.write_windows, ids, payloads)
            filled = wanted
    except Exception:  # a damaged or foreign window costs a replay, never the request
        log.exception("reading a window from the disk tier failed; replaying instead")
    finally:
        window.commit(filled)
    return end if filled else 0


async def _window_on_disk(
    window: WindowGroup, disk: DiskTier, hit: Sequence[BlockHash]
) -> int | None:
    """The latest boundary past the replay start whose window the disk tier indexes."""
    bs = window.block_size
    floor = window.spec.replay_start(len(hit) * bs, bs)
    first = window.spec.first_block_needed(floor, bs)
    keys = [window_key(h) for h in hit[first:]]
    try:
        present = await asyncio.to_thread(_indexed, disk, keys)
    except Exception:
        log.exception("disk tier lookup failed; replaying instead")
        return None
    return best_window_end(window.spec, bs, [False] * first + present, floor)


def _indexed(disk: DiskTier, keys: Sequence[BlockHash]) -> list[bool]:
    return [disk.contains_prefix([key]) == 1 for key in keys]
