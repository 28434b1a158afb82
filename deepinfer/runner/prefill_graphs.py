"""Prefill steps replayed from CUDA graphs, piecewise: a graph per piece between two attention
calls (`model/piecewise.py`), captured once per token-count bucket.

An eager prefill step on a GPU is a dozen or more launches a layer, each dropping and retaking
the GIL while the event loop streams answers: an 8000-token prompt waited 12.7 s for its first
token beside 16 streams (bench/RESULTS.md). Replayed, a step of T tokens pads to the next bucket
and is L + 1 graph launches with L attention calls between them, attention running eagerly on
the step's own requests (their contexts and block tables are not a function of T, so they are
not captured).

The buckets are 16, 32, 64, 128, 256, 512, then every 256 up to the step's token budget
(`--max-num-batched-tokens`): at most a third of a padded step is padding past 512 tokens. Every
bucket's pieces share one memory pool (a step replays one bucket at a time); the decode graphs
keep their own, so the two workers never write each other's buffers.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import torch

from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.llama import LlamaForCausalLM
from deepinfer.model.piecewise import PiecewiseForward
from deepinfer.model.protocol import CausalLM
from deepinfer.runner.cuda_graphs import capture_in_mode

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE as _PoolHandle


def prefill_buckets(max_tokens: int) -> tuple[int, ...]:
    """The token counts captured: powers of two from 16 to 512, then every 256, and
    `max_tokens` itself (nothing above it)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    sizes = {16, 32, 64, 128, 256, 512, *range(768, max_tokens + 1, 256), max_tokens}
    return tuple(sorted(s for s in sizes if s <= max_tokens))


def bucket_for(batch: ForwardBatch, buckets: tuple[int, ...]) -> int | None:
    """The bucket (ascending `buckets`) a step replays at, or None: too many tokens."""
    i = bisect.bisect_left(buckets, batch.num_tokens)
    return buckets[i] if i < len(buckets) else None


class GraphCapture(Protocol):
    """How pieces are captured and replays ordered: CUDA graphs (`CudaGraphCapture`), or in
    tests on CPU the pieces themselves, run where their graphs would replay."""

    def capture(self, piece: Callable[[], None]) -> Callable[[], None]:
        """Capture `piece` (already warmed up); returns what replays it."""
        ...

    def synchronize(self) -> None: ...

    def before_replay(self) -> None:
        """On this thread's stream, wait until the previous step (any stream) is done with the
        static buffers."""
        ...

    def after_replay(self) -> None: ...


class CudaGraphCapture:
    """CUDA graphs sharing one memory pool (the first capture's), and an event marking where the
    last replayed step ends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: _PoolHandle | None = None
        self._done = torch.cuda.Event()

    def capture(self, piece: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            piece()
        self._pool = graph.pool()
        return graph.replay

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def before_replay(self) -> None:
        torch.cuda.current_stream().wait_event(self._done)

    def after_replay(self) -> None:
        self._done.record(torch.cuda.current_stream())


class PrefillGraphs:
    """Every bucket's pieces captured; `run` replays a step's (serialized: one set of buffers)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        max_tokens: int,
        device: torch.device,
        capture: GraphCapture | None = None,
    ) -> None:
        self.buckets = prefill_buckets(max_tokens)
        self._capture = capture if capture is not None else CudaGraphCapture(device)
        start = time.perf_counter()
        self.pieces = PiecewiseForward(model, self.buckets[-1], device)  # warms the largest up
        self._replays: dict[int, list[Callable[[], None]]] = {}
        self._lock = threading.Lock()
        self.num_replays = 0
        for tokens in reversed(self.buckets):  # largest first: the others reuse its memory
            pieces = [self.pieces.piece(i, tokens) for i in range(self.pieces.num_pieces)]
            for piece in pieces:  # warm-up: compiles this bucket's kernels
                piece()
            self._capture.synchronize()
            self._replays[tokens] = [self._capture.capture(piece) for piece in pieces]
        self._capture.synchronize()
        log.info(
            "captured prefill CUDA graphs: %d pieces x %d token buckets (%s) in %.1f s",
            self.pieces.num_pieces, len(self.buckets), ",".join(map(str, self.buckets)),
            time.perf_counter() - start,
        )  # fmt: skip

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The logits [B_sample, V] of a step from its bucket's pieces, or None: run it
        eagerly (more tokens than the largest bucket)."""
        tokens = bucket_for(batch, self.buckets)
        if tokens is None:
            return None
        replays = self._replays[tokens]
        with self._lock:
            self._capture.before_replay()
            logits = self.pieces.forward(batch, tokens, lambda i: replays[i]())
            self._capture.after_replay()
            self.num_replays += 1
        return logits


def capture_prefill_graphs(
    mode: str, model: CausalLM, device: torch.device, max_tokens: int
) -> PrefillGraphs | None:
    """Captured pieces per `--cuda-graphs` (auto|on|off), or None: eager prefill steps.

    `auto` captures on CUDA for the Llama-family decoders (Mixture-of-Experts models excepted:
    their experts' row counts change every step); `on` raises ConfigError where that is not the
    case; a capture that fails under `auto` is logged and leaves prefill eager.
    """
    why_not = (
        f"prefill CUDA graphs need a CUDA device, not {device}"
        if device.type != "cuda"
        else "prefill CUDA graphs need a Llama-family decoder"
        if not isinstance(model, LlamaForCausalLM)
        else "Mixture-of-Experts models prefill eagerly"
        if model.arch.moe is not None
        else None
    )
    return capture_in_mode(
        mode,
        why_not,
        device,
        "prefill",
        lambda: PrefillGraphs(cast(LlamaForCausalLM, model), max_tokens, device),
    )
