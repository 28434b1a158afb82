"""The host-RAM tier's memory and its copies into KV blocks (the forward thread runs the copies).

On CUDA the tier's slots live in page-locked chunks allocated at start-up, so a block goes from
its slot to the device as one DMA transfer, with no staging copy on the host. On CPU the slots are
plain memory, allocated as they fill.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from deepinfer.cache.host.arena import allocate_bytearray
from deepinfer.cache.host.tier import HostTier
from deepinfer.config import HostCacheConfig
from deepinfer.model.kv_layout import KVCaches
from deepinfer.runner.kv_transfer import block_payload_bytes

log = logging.getLogger("deepinfer.runner")

MAX_RAM_FRACTION = 0.5
"""The tier never takes more than this share of the machine's physical memory."""


def host_tier_enabled(config: HostCacheConfig, device: torch.device) -> bool:
    return config.enabled == "on" or (config.enabled == "auto" and device.type == "cuda")


def allocate_pinned(num_bytes: int) -> memoryview:
    """A page-locked chunk; the memoryview keeps the tensor (and the memory) alive."""
    chunk = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    return chunk.numpy().data


def _ram_cap_bytes() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * MAX_RAM_FRACTION)
    except (ValueError, OSError):
        return 1 << 62


def open_host_tier(
    config: HostCacheConfig, device: torch.device, kv_caches: KVCaches
) -> HostTier | None:
    """The host tier for these KV caches (payloads the size of one block), or None when off."""
    if not host_tier_enabled(config, device):
        return None
    payload_bytes = block_payload_bytes(kv_caches)
    max_bytes = min(config.max_bytes, _ram_cap_bytes())
    if max_bytes < config.max_bytes:
        log.warning("host cache budget capped to %.1f GiB (half the RAM)", max_bytes / (1 << 30))
    if max_bytes < payload_bytes:
        log.warning("host cache budget below one KV block (%d bytes): host tier off", payload_bytes)
        return None
    pinned = device.type == "cuda"
    tier = HostTier(
        payload_bytes,
        max_bytes,
        allocate_pinned if pinned else allocate_bytearray,
        preallocate=pinned,
    )
    log.info(
        "host cache: %d blocks of %d bytes (%s)",
        tier.num_slots,
        payload_bytes,
        "page-locked" if pinned else "pageable",
    )
    return tier


@torch.inference_mode()
def write_blocks_from_views(
    kv_caches: KVCaches, block_ids: Sequence[int], views: Sequence[memoryview]
) -> None:
    """Fill blocks from payload views (host-tier slots, same layout as `read_blocks` payloads).
    Returns once the copies are done, so the caller may release the views' slots."""
    if not block_ids:
        return
    assert len(views) == len(block_ids)
    k0 = kv_caches[0][0]
    expected = block_payload_bytes(kv_caches)
    if any(v.nbytes != expected for v in views):
        raise ValueError(f"KV payloads must be {expected} bytes each")
    staging = torch.empty((len(views), expected), dtype=torch.uint8, device=k0.device)
    for row, view in zip(staging, views, strict=True):
        row.copy_(torch.frombuffer(view, dtype=torch.uint8), non_blocking=True)
    shape = (len(block_ids), len(kv_caches), 2, *k0.shape[1:])  # [n, L, 2, S, H, D]
    data = staging.view(k0.dtype).view(shape)
    idx = torch.tensor(list(block_ids), dtype=torch.int64, device=k0.device)
    for layer, (k, v) in enumerate(kv_caches):
        k[idx] = data[:, layer, 0]
        v[idx] = data[:, layer, 1]
    if k0.device.type == "cuda":
        torch.cuda.current_stream(k0.device).synchronize()
