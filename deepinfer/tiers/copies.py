"""KV blocks <-> bytes, for the lower tiers (host RAM, disk). Runs on the forward thread.

A block's payload is its K and V for every layer, `[L, 2, S, Hkv, D]` in the serving dtype, as
raw bytes. The model fingerprint (dtype and KV layout included) keys the tier, so a payload is
only ever read back into caches of the same shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.model.kv_layout import KVCaches


def block_payload_bytes(kv_caches: KVCaches) -> int:
    k = kv_caches[0][0]
    return len(kv_caches) * 2 * k[0].numel() * k.element_size()


@torch.inference_mode()
def read_blocks(kv_caches: KVCaches, block_ids: Sequence[int]) -> list[bytes]:
    """Snapshot blocks as payloads (a copy: the blocks may be reused after this returns)."""
    if not block_ids:
        return []
    device = kv_caches[0][0].device
    idx = torch.tensor(list(block_ids), dtype=torch.int64, device=device)
    per_layer = [torch.stack((k[idx], v[idx]), dim=1) for k, v in kv_caches]  # L x [n, 2, S, H, D]
    stacked = torch.stack(per_layer, dim=1).cpu().contiguous()  # [n, L, 2, S, H, D]
    raw = stacked.view(stacked.shape[0], -1).view(torch.uint8)  # [n, bytes]
    return [raw[i].numpy().tobytes() for i in range(raw.shape[0])]


@torch.inference_mode()
def write_blocks(kv_caches: KVCaches, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
    """Fill blocks from payloads made by `read_blocks` with the same layout."""
    if not block_ids:
        return
    k0 = kv_caches[0][0]
    shape = (len(block_ids), len(kv_caches), 2, *k0.shape[1:])  # [n, L, 2, S, H, D]
    expected = block_payload_bytes(kv_caches)
    if any(len(p) != expected for p in payloads):
        raise ValueError(f"KV payloads must be {expected} bytes each")
    raw = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
    data = raw.view(k0.dtype).view(shape).to(k0.device)
    idx = torch.tensor(list(block_ids), dtype=torch.int64, device=k0.device)
    for layer, (k, v) in enumerate(kv_caches):
        k[idx] = data[:, layer, 0]
        v[idx] = data[:, layer, 1]


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


@dataclass(frozen=True)
class TierCopies:
    """The copies between the prefill pool's blocks and the tiers' payloads (blocking: run them
    on the forward thread, on blocks no step writes)."""

    kv_caches: KVCaches
    """The caches a block's payload covers (all layers, or the full layers')."""
    window_caches: KVCaches
    """The sliding-window layers' caches where they have a pool of their own (else empty)."""

    def read(self, block_ids: Sequence[int]) -> list[bytes]:
        return read_blocks(self.kv_caches, block_ids)

    def write(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        write_blocks(self.kv_caches, block_ids, payloads)

    def write_views(self, block_ids: Sequence[int], views: Sequence[memoryview]) -> None:
        write_blocks_from_views(self.kv_caches, block_ids, views)

    def read_windows(self, block_ids: Sequence[int]) -> list[bytes]:
        return read_blocks(self.window_caches, block_ids)

    def write_windows(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        write_blocks(self.window_caches, block_ids, payloads)
