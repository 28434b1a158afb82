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

import torch

from deepinfer.errors import ConfigError
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.llama import LlamaForCausalLM
from deepinfer.model.piecewise import PiecewiseForward
from deepinfer.model.protocol import CausalLM

log = logging.getLogger(__name__)


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


class PrefillGraphs:
    """Every bucket's pieces captured; `run` replays a step's (serialized: one set of buffers)."""

    def __init__(self, model: LlamaForCausalLM, max_tokens: int, device: torch.device) -> None:
        self.buckets = prefill_buckets(max_tokens)
        start = time.perf_counter()
        self.pieces = PiecewiseForward(model, self.buckets[-1], device)  # warms the largest up
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._lock = threading.Lock()
        self._done = torch.cuda.Event()
        self.num_replays = 0
        pool = None
        for tokens in reversed(self.buckets):  # largest first: the others reuse its memory
            pieces = [self.pieces.piece(i, tokens) for i in range(self.pieces.num_pieces)]
            for piece in pieces:  # warm-up: compiles this bucket's kernels
                piece()
            torch.cuda.synchronize(device)
            graphs = []
            for piece in pieces:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    piece()
                pool = graph.pool()
                graphs.append(graph)
            self._graphs[tokens] = graphs
        torch.cuda.synchronize(device)
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
        graphs = self._graphs[tokens]
        with self._lock:
            stream = torch.cuda.current_stream()
            stream.wait_event(self._done)
            logits = self.pieces.forward(batch, tokens, lambda i: graphs[i].replay())
            self._done.record(stream)
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
    if mode == "off" or (mode == "auto" and why_not is not None):
        return None
    if why_not is not None:
        raise ConfigError(f"--cuda-graphs on: {why_not}")
    assert isinstance(model, LlamaForCausalLM)
    try:
        with torch.cuda.device(device):
            return PrefillGraphs(model, max_tokens, device)
    except (RuntimeError, ValueError) as exc:
        if mode == "on":
            raise
        log.warning("prefill CUDA graphs could not be captured (%s): prefill runs eagerly", exc)
        torch.cuda.synchronize(device)
        return None
