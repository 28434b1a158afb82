"""Decode steps replayed from CUDA graphs: one launch a step instead of ~500.

Eager decode on a GPU is all launch overhead: 30 layers of small kernels cost ~20 ms of Python
and launches for microseconds of device work, and the prefill worker waits on the same GIL to
launch its own. At start-up the model's decode forward (through the logits) is captured once per
padded batch size, on static input buffers. A decode-only step whose every row samples copies
its inputs into the buffers, pads the rest of its size class (padding rows write no KV: slot -1;
read one token of the null block 0), replays, and gets the first B rows of the logits.

The block-table buffer is as wide as the longest context, so the Triton decode kernel's grid is
fixed (its partitions past a request's context return at once). Only the Triton backend is
captured: the torch path builds a host-side plan every step (a device sync).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from deepinfer.errors import ConfigError
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.protocol import CausalLM

log = logging.getLogger(__name__)

G = TypeVar("G")


def graph_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The padded batch sizes captured: 1, 2, 4, 8, then every 16, and `max_batch` itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    sizes = {1, 2, 4, 8, *range(16, max_batch + 1, 16), max_batch}
    return tuple(sorted(s for s in sizes if s <= max_batch))


def replay_size(batch: ForwardBatch, sizes: tuple[int, ...], max_blocks: int) -> int | None:
    """The captured size (ascending `sizes`) to replay `batch` at, or None: run it eagerly
    (prefill chunks, a row that samples nothing, too many requests or too wide a table)."""
    n = batch.num_requests
    if not batch.is_decode_only or batch.logits_indices.shape[0] != n:
        return None
    if batch.block_tables.shape[1] > max_blocks:
        return None
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class StaticDecodeInputs:
    """Input buffers of the largest captured batch; `batch(n)` views the first n rows."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        int32, int64 = torch.int32, torch.int64
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.input_ids = torch.zeros(max_batch, dtype=int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=int64, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=int32, device=device)
        self.context_lens = torch.ones(max_batch, dtype=int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=int32, device=device)
        self.logits_indices = torch.arange(max_batch, dtype=int64, device=device)

    def batch(self, size: int) -> ForwardBatch:
        """The decode batch of the first `size` rows (views: a graph captured on it reads
        whatever `load` writes later)."""
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            context_lens=self.context_lens[:size],
            is_decode_only=True,
            logits_indices=self.logits_indices[:size],
        )

    def load(self, batch: ForwardBatch, size: int) -> None:
        """Copy a decode batch of n <= size rows in; rows n..size become padding."""
        n, width = batch.num_requests, batch.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.context_lens[:n].copy_(batch.context_lens)
        self.block_tables[:n, :width].copy_(batch.block_tables)
        self.block_tables[:n, width:].zero_()
        if n < size:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.context_lens[n:size].fill_(1)
            self.block_tables[n:size].zero_()


@dataclass(frozen=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [size, V] float32, the graph's output buffer


class DecodeGraphs:
    """Captured decode forwards, replayed for decode-only steps that fit them.

    `run` may be called from both workers' threads (a prefill step can be one token per request
    too): replays are serialized, and each waits on the device for the previous one (on any
    stream) to be done with the shared buffers.
    """

    def __init__(self, model: CausalLM, max_batch: int, max_blocks: int, device: torch.device):
        self.sizes = graph_batch_sizes(max_batch)
        self.inputs = StaticDecodeInputs(self.sizes[-1], max_blocks, device)
        self._graphs: dict[int, _Graph] = {}
        self._lock = threading.Lock()
        self._done = torch.cuda.Event()
        self.num_replays = 0
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):  # largest first: the others reuse its memory
            batch = self.inputs.batch(size)
            model(batch)  # warm-up: compiles the Triton kernels, creates cuBLAS handles
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                logits = model(batch)
            pool = graph.pool()
            self._graphs[size] = _Graph(graph, logits)
        torch.cuda.synchronize(device)
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
            len(self.sizes), ",".join(map(str, self.sizes)), time.perf_counter() - start,
        )  # fmt: skip

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The logits [B, V] of a decode batch from its graph, or None (run it eagerly)."""
        size = replay_size(batch, self.sizes, self.inputs.max_blocks)
        if size is None:
            return None
        graph = self._graphs[size]
        with self._lock:
            stream = torch.cuda.current_stream()
            stream.wait_event(self._done)
            self.inputs.load(batch, size)
            graph.graph.replay()
            logits = graph.logits[: batch.num_requests].clone()
            self._done.record(stream)
            self.num_replays += 1
        return logits


def capture_decode_graphs(
    mode: str, model: CausalLM, device: torch.device, max_batch: int, max_blocks: int
) -> DecodeGraphs | None:
    """Captured graphs per `--cuda-graphs` (auto|on|off), or None: eager decode steps.

    `auto` captures on CUDA with the Triton backend; `on` raises ConfigError where that is not
    the case; a capture that fails under `auto` is logged and leaves decode eager.
    """
    backend = model.attention_backend.name
    why_not = (
        f"decode CUDA graphs need a CUDA device, not {device}"
        if device.type != "cuda"
        else f"decode CUDA graphs need the Triton attention backend, not {backend}"
        if backend != "triton"
        else None
    )
    return capture_in_mode(
        mode, why_not, device, "decode", lambda: DecodeGraphs(model, max_batch, max_blocks, device)
    )


def capture_in_mode(
    mode: str, why_not: str | None, device: torch.device, what: str, capture: Callable[[], G]
) -> G | None:
    """`capture()` on `device` per `--cuda-graphs` `mode`, where `why_not` (None: graphs can be
    captured here) allows: None under `off`, or under `auto` where they cannot be or the capture
    fails (logged: `what` steps run eagerly); under `on`, ConfigError or the capture's error."""
    if mode == "off" or (mode == "auto" and why_not is not None):
        return None
    if why_not is not None:
        raise ConfigError(f"--cuda-graphs on: {why_not}")
    try:
        with torch.cuda.device(device):  # capture on the model's device (e.g. the decode group's)
            return capture()
    except (RuntimeError, ValueError) as exc:
        if mode == "on":
            raise
        log.warning("%s CUDA graphs could not be captured (%s): %s runs eagerly", what, exc, what)
        torch.cuda.synchronize(device)
        return None
