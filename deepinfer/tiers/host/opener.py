"""The host-RAM tier's memory: the tier opened for a pool's KV caches (the copies into KV blocks
are in `tiers/copies.py`).

On CUDA the tier's slots live in page-locked chunks allocated at start-up, so a block goes from
its slot to the device as one DMA transfer, with no staging copy on the host. On CPU the slots are
plain memory, allocated as they fill.
"""

from __future__ import annotations

import logging
import os

import torch

from deepinfer.config import HostCacheConfig
from deepinfer.model.kv_layout import KVCaches
from deepinfer.tiers.copies import block_payload_bytes
from deepinfer.tiers.host.arena import allocate_bytearray
from deepinfer.tiers.host.tier import HostTier

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
