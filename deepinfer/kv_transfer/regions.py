"""`KVRegions`: a KV pool as NIXL sees it: one memory region per layer and K or V, each
`[num_blocks, ...]` with every block contiguous, so block b of region r is one descriptor
`(base_r + b * block_bytes_r, block_bytes_r, device)`."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import torch

from deepinfer.model.kv_layout import KVCaches


class Region(msgspec.Struct, frozen=True, array_like=True):
    address: int
    num_blocks: int
    block_bytes: int


class KVRegions(msgspec.Struct, frozen=True):
    regions: tuple[Region, ...]
    memory: str
    """NIXL's memory kind: `DRAM` (CPU) or `VRAM` (a GPU)."""
    device_id: int

    def compatible(self, other: KVRegions) -> bool:
        """Same number of regions and block sizes: blocks copy one for one."""
        return len(self.regions) == len(other.regions) and all(
            a.block_bytes == b.block_bytes for a, b in zip(self.regions, other.regions, strict=True)
        )

    def descriptors(self, starts: Sequence[int], lengths: Sequence[int]) -> np.ndarray:
        """`[len(regions) * len(starts), 3]` rows of (address, bytes, device), region-major:
        run j of each region covers blocks `starts[j]` to `starts[j] + lengths[j] - 1`."""
        first = np.asarray(starts, dtype=np.uint64)
        count = np.asarray(lengths, dtype=np.uint64)
        rows = []
        for r in self.regions:
            if len(first) and int((first + count).max()) > r.num_blocks:
                raise ValueError(f"blocks past the end of a {r.num_blocks}-block region")
            block = np.empty((len(first), 3), dtype=np.uint64)
            block[:, 0] = np.uint64(r.address) + first * np.uint64(r.block_bytes)
            block[:, 1] = count * np.uint64(r.block_bytes)
            block[:, 2] = self.device_id
            rows.append(block)
        return np.concatenate(rows) if rows else np.empty((0, 3), dtype=np.uint64)


def runs(
    local_ids: Sequence[int], remote_ids: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    """(local starts, remote starts, lengths): the pairs cut into runs consecutive on both
    sides, so a read of n blocks is as few descriptors as the two pools' layouts allow."""
    local_starts: list[int] = []
    remote_starts: list[int] = []
    lengths: list[int] = []
    for local, remote in zip(local_ids, remote_ids, strict=True):
        if (
            lengths
            and local == local_starts[-1] + lengths[-1]
            and remote == remote_starts[-1] + lengths[-1]
        ):
            lengths[-1] += 1
        else:
            local_starts.append(local)
            remote_starts.append(remote)
            lengths.append(1)
    return local_starts, remote_starts, lengths


def kv_regions(caches: KVCaches) -> KVRegions:
    tensors = [t for pair in caches for t in pair]
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("KV transfer needs contiguous caches")
    device = tensors[0].device
    return KVRegions(
        tuple(Region(t.data_ptr(), t.shape[0], t[0].numel() * t.element_size()) for t in tensors),
        "VRAM" if device.type == "cuda" else "DRAM",
        device.index or 0 if device.type == "cuda" else 0,
    )


def region_tensors(caches: KVCaches) -> list[torch.Tensor]:
    return [t for pair in caches for t in pair]
