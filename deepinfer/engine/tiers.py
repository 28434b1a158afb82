"""Moving KV between the device pool and the disk tier, from the event loop.

Both directions keep the loop free: LMDB and file reads run on worker threads, KV tensor copies on
the forward thread (serialized with forward passes, so a block is never read while being written).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor

from deepinfer.config import RETENTION_CLASSES
from deepinfer.engine.core import EngineCore
from deepinfer.errors import InvalidRequestError
from deepinfer.request import Request

log = logging.getLogger("deepinfer.engine")


def check_retention(retention: str | None) -> None:
    if retention is not None and retention not in RETENTION_CLASSES:
        raise InvalidRequestError(
            f"cache_retention must be one of {', '.join(RETENTION_CLASSES)}, got {retention!r}",
            param="cache_retention",
        )


async def fill_from_disk(core: EngineCore, forward: Executor, request: Request) -> int:
    """Load the prompt's leading blocks that are on disk but not on the device into free device
    blocks, registered under their hashes, so admission hits them. Returns the tokens loaded."""
    tier, kv = core.disk, core.kv
    if tier is None or not kv.enable_prefix_caching or request.retention == "none":
        return 0
    hashes = kv.prompt_hashes(request)
    rest = hashes[kv.cached_prefix_len(hashes) :]
    if not rest:
        tier.touch(hashes, request.retention)
        return 0
    num_on_disk = await asyncio.to_thread(tier.contains_prefix, rest)
    reservation = kv.reserve_blocks(num_on_disk) if num_on_disk else None
    if reservation is None:
        return 0
    reservation_id, block_ids = reservation
    num_loaded = 0
    try:
        payloads = await asyncio.to_thread(tier.load, rest[:num_on_disk])
        while num_loaded < len(payloads) and payloads[num_loaded] is not None:
            num_loaded += 1
        loaded = [p for p in payloads[:num_loaded] if p is not None]
        if loaded:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(forward, core.fill_blocks, block_ids[:num_loaded], loaded)
    finally:
        kv.commit_reserved(reservation_id, rest[:num_loaded])
    tier.touch(hashes[: len(hashes) - len(rest) + num_loaded], request.retention)
    return num_loaded * kv.block_size


async def write_behind(core: EngineCore, forward: Executor) -> None:
    """Offer blocks registered in the last step to the disk tier (a snapshot copy on the forward
    thread now; the write itself happens on the tier's writer thread, or is dropped)."""
    new = [b for b in core.kv.drain_new_blocks() if b[2] != "none"]
    if not new or core.disk is None:
        return
    loop = asyncio.get_running_loop()
    payloads = await loop.run_in_executor(forward, core.snapshot_blocks, [b[0] for b in new])
    core.offer_to_disk([(b[1], b[2]) for b in new], payloads)
