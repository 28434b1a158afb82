"""KV blocks <-> bytes, for the lower cache tiers (disk). Runs on the forward thread.

A block's payload is its K and V for every layer, `[L, 2, S, Hkv, D]` in the serving dtype, as
raw bytes. The model fingerprint (dtype and KV layout included) keys the tier, so a payload is
only ever read back into caches of the same shape.
"""

from __future__ import annotations

from collections.abc import Sequence

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
