"""Allowed-token masks filled while the forward pass runs (structured output at full speed).

A step's mask is started as soon as the runner has the step (`MaskFiller.fill`, entered before
the forward pass) and waited for only when the sampler needs it (`PendingMask.wait`):

1. On the worker's thread, the step's constrained rows and their matchers are looked up
   (`MatcherTable.mask_rows`; a matcher is made on its request's first step). When no row is
   constrained nothing else happens: no job, no buffer, no thread (the pool is made on the first
   constrained step). Unconstrained traffic pays one scan of the step's parameters.
2. A job on the runner's fill pool (one thread per worker lane) catches each row's matcher up
   with its request's kept outputs (the token sampled by the step before is accepted here, off
   the sampling path), writes its row of the packed bitmask (llguidance computes it with the
   GIL released; a request verifying drafts gets a row per position, its matcher walked along
   the drafts and rolled back), then makes the mask the sampler applies: on CPU an additive float32 `[B, V]`
   (0 or -inf: the sampler's copy of the logits and the mask become one add), elsewhere the
   packed words (32x fewer bytes to the device, unpacked there).
3. The sampler's input is `wait()`: the job's mask, or its exception raised on the worker.

Invariants:

- A matcher is advanced only inside the job of a step that samples its request, and `fill`
  never exits while its job runs, even when the forward pass raises: the step's release,
  a handoff to another runner (`take`/`adopt`) and the request's next step all come after its
  job ended. The scheduler puts a request in one step at a time, so the jobs of two workers'
  overlapping steps touch disjoint matchers.
- The overlap is taken only where a core is left for the fill (`MaskFiller.overlap`): on CPU,
  a step whose forward pass runs on every core fills after it instead.
- The mask does not depend on the overlap: with `overlap` off (the A/B switch of tests and
  benchmarks) the same job runs on the worker's thread when the sampler asks for the mask,
  after the forward pass, as a synchronous fill would.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress

import numpy as np
import torch

from deepinfer.sampling.masking import additive_mask
from deepinfer.sampling.matchers import MaskRow, MatcherTable, SampledRequest, fill_rows

NUM_CORES = (
    len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
)
"""The cores this process may run on."""
NUM_FILL_THREADS = 2
"""One per worker lane (prefill and decode share a runner on one device group)."""


class PendingMask:
    """One step's mask: being filled on the pool, or (overlap off) filled when first asked."""

    def __init__(self, job: Future[torch.Tensor] | None, run: MaskJob) -> None:
        self._future = job
        self._run = run
        self._mask: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """The step's mask (see `masking.py` for its two forms); the job's error if it failed."""
        if self._mask is None:
            self._mask = self._future.result() if self._future is not None else self._run()
        return self._mask

    def settle(self) -> None:
        """Wait for the job to end, whatever it returns (the step failed: its error wins)."""
        if self._future is not None:
            with suppress(Exception):
                self._future.result()


class MaskJob:
    """Filling one step's mask: the rows, then the sampler's form of it."""

    def __init__(
        self,
        rows: Sequence[MaskRow],
        num_rows: int,
        vocab_size: int,
        buffers: LaneBuffers | None,
    ):
        self.rows = rows
        self.num_rows = num_rows
        self.vocab_size = vocab_size
        self.buffers = buffers
        """The lane's reused arrays (CPU: the additive form); None: packed words, new each
        step (they go to the device)."""

    def __call__(self) -> torch.Tensor:
        num_words = -(-self.vocab_size // 32)
        if self.buffers is None:
            words = np.full((self.num_rows, num_words), -1, dtype=np.int32)  # [B, W]
            fill_rows(words, self.rows)
            return torch.from_numpy(words)
        words, out = self.buffers.get(self.num_rows, num_words)
        words.fill(-1)
        fill_rows(words, self.rows)
        return torch.from_numpy(additive_mask(words, self.vocab_size, out))  # [B, V] float32


class LaneBuffers:
    """One worker lane's arrays for its steps' CPU masks, grown to the most rows a step has had
    and reused: a lane's next step starts its job only after this step's sampler has read the
    mask, so a step never overwrites a mask in use, and no page is faulted in again each step."""

    def __init__(self) -> None:
        self._words = np.empty((0, 0), dtype=np.int32)
        self._out = np.empty((0, 0), dtype=np.uint32)

    def get(self, num_rows: int, num_words: int) -> tuple[np.ndarray, np.ndarray]:
        """The packed words `[B, W]` and the additive form's buffer (`additive_mask`'s `out`)."""
        if len(self._words) < num_rows or self._words.shape[1] != num_words:
            self._words = np.empty((num_rows, num_words), dtype=np.int32)
            self._out = np.empty((num_rows, 32 * num_words), dtype=np.uint32)
        return self._words[:num_rows], self._out


class MaskFiller:
    """A runner's step masks, filled on its own small pool while the forward pass runs."""

    def __init__(self, matchers: MatcherTable, device: torch.device) -> None:
        self.matchers = matchers
        self.additive = device.type == "cpu"
        """CPU: the additive form (the add replaces the sampler's copy); elsewhere packed."""
        self.overlap: bool | None = None
        """Fill while the forward pass runs: None (the default) where a core is left for the
        fill, True always (tests), False never: after the forward pass, on the worker's thread.
        A CPU forward pass on every core of the process waits for the thread whose core the fill
        takes (its threads meet at each op), so there the fill costs more beside it than after
        it (`bench/structured.py`)."""
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._buffers: dict[int, LaneBuffers] = {}
        """Per worker lane (the thread that starts its steps' fills)."""

    @contextmanager
    def fill(
        self, sampled: Sequence[SampledRequest], vocab_size: int
    ) -> Iterator[PendingMask | None]:
        """The mask of a step sampling `sampled` (in order: each request's row, then one per
        draft it verifies), started now; None when none of them is constrained. On exit the
        job has ended, whatever the body did."""
        pending = self.start(sampled, vocab_size)
        try:
            yield pending
        finally:
            if pending is not None:
                pending.settle()

    def start(self, sampled: Sequence[SampledRequest], vocab_size: int) -> PendingMask | None:
        """Start filling (see `fill`, which also waits for the job on the way out)."""
        rows = self.matchers.mask_rows(sampled)
        if not rows:
            return None
        num_rows = sum(1 + len(drafts) for _, drafts in sampled)
        buffers = None
        if self.additive:
            buffers = self._buffers.setdefault(threading.get_ident(), LaneBuffers())
        job = MaskJob(rows, num_rows, vocab_size, buffers)
        overlap = self.overlap if self.overlap is not None else self._core_left()
        return PendingMask(self._executor().submit(job) if overlap else None, job)

    def _core_left(self) -> bool:
        """Whether this step's forward pass leaves a core for the fill."""
        return not self.additive or torch.get_num_threads() < NUM_CORES

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    NUM_FILL_THREADS, thread_name_prefix="deepinfer-mask-fill"
                )
            return self._pool

    def close(self) -> None:
        """Stop the fill pool (blocking: waits for a job in flight; call off the loop)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    @property
    def has_pool(self) -> bool:
        """Whether a constrained step has run here with the overlap on (the pool exists)."""
        return self._pool is not None
