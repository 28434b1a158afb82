"""Copying a request's KV from the prefill pool to the decode pool (separate device groups).

The copy runs on the engine's transfer thread, never on the event loop or a worker's thread. On
CUDA it is enqueued on transfer streams of its own (one per device, so neither worker's stream
waits for it), and `copy` returns when the event recorded after it has completed: only then does
the decode worker admit the request. The source blocks were written by a finished prefill step
(its stream synchronized) and stay referenced until the copy is done; the destination blocks are
fresh ones no step can see yet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from deepinfer.model.kv_layout import KVCaches


class KVCopier:
    def __init__(self, src: KVCaches, dst: KVCaches) -> None:
        if len(src) != len(dst) or src[0][0].shape[1:] != dst[0][0].shape[1:]:
            raise ValueError("the two KV pools differ in layers or block shape")
        if src[0][0].dtype != dst[0][0].dtype:
            raise ValueError("the two KV pools differ in dtype")
        self.src = src
        self.dst = dst
        self.src_device = src[0][0].device
        self.dst_device = dst[0][0].device
        self._streams = tuple(
            torch.cuda.Stream(device)
            for device in {self.src_device, self.dst_device}
            if device.type == "cuda"
        )

    @contextlib.contextmanager
    def _on_transfer_streams(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for stream in self._streams:
                stack.enter_context(torch.cuda.stream(stream))
            yield

    @torch.inference_mode()
    def copy(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> None:
        """Copy whole blocks, every layer's K and V; returns once the copy is complete."""
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError("a handoff copies as many blocks as it fills")
        if not src_block_ids:
            return
        with self._on_transfer_streams():
            src_idx = torch.tensor(list(src_block_ids), dtype=torch.int64, device=self.src_device)
            dst_idx = torch.tensor(list(dst_block_ids), dtype=torch.int64, device=self.dst_device)
            for src_pair, dst_pair in zip(self.src, self.dst, strict=True):
                for src_cache, dst_cache in zip(src_pair, dst_pair, strict=True):
                    blocks = src_cache.index_select(0, src_idx)
                    dst_cache.index_copy_(0, dst_idx, blocks.to(self.dst_device, non_blocking=True))
            events = [torch.cuda.Event() for _ in self._streams]
            for event, stream in zip(events, self._streams, strict=True):
                event.record(stream)
        for event in events:
            event.synchronize()
