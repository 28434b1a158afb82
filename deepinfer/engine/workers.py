"""Workers: each runs one scheduler lane's forward passes on its own thread, with its own share
of CPU cores (torch's thread count is per calling thread) or its own CUDA stream.

The colocated mode has one worker (`mixed`); the disaggregated mode a `prefill` and a `decode`
worker whose steps overlap. A worker's thread count is set on its own thread before a step, so
two workers never oversubscribe the cores they were given. With `lend_idle_threads`, a worker
whose peer has nothing to do runs its step on both shares (`ThreadLending`); the peer then waits
for that step to end before starting its own (at most one step, bounded by the prefill time
budget or one decode).

A step that raises on the worker's thread raises from `Worker.run`; on CUDA the worker first
waits for the step's queued kernels (its blocks must not be reused under them). When even that
wait fails, the device is lost: `run` raises `FatalEngineError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from deepinfer.config import WorkersConfig
from deepinfer.engine.core import EngineCore
from deepinfer.engine.types import WorkerStats
from deepinfer.errors import FatalEngineError
from deepinfer.outputs import RunnerOutput
from deepinfer.scheduler.output import ScheduleOutput
from deepinfer.scheduler.protocol import StepLane

_BUSY_WINDOW_S = 10.0


class BusyMeter:
    """Busy time over a sliding window, from (start, end) intervals of finished steps."""

    def __init__(self, window_s: float = _BUSY_WINDOW_S) -> None:
        self.window_s = window_s
        self._intervals: deque[tuple[float, float]] = deque()
        self._running_since: float | None = None
        self.num_steps = 0
        self.busy_s_total = 0.0

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        start = self._running_since = time.monotonic()
        try:
            yield
        finally:
            end = time.monotonic()
            self._running_since = None
            self._intervals.append((start, end))
            self.num_steps += 1
            self.busy_s_total += end - start

    def fraction(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        since = now - self.window_s
        while self._intervals and self._intervals[0][1] < since:
            self._intervals.popleft()
        busy = sum(end - max(start, since) for start, end in self._intervals)
        if self._running_since is not None:
            busy += now - max(self._running_since, since)
        return min(busy / self.window_s, 1.0)


def thread_shares(config: WorkersConfig, num_cores: int) -> tuple[int, int]:
    """(prefill, decode) CPU threads: as configured, else prefill half the cores (at least one)
    and decode the rest (at least one)."""
    prefill = config.prefill_threads or max(1, num_cores // 2)
    decode = config.decode_threads or max(1, num_cores - prefill)
    return prefill, decode


class Worker:
    """One lane, its thread and its stream. `execute` runs on the worker's thread."""

    def __init__(
        self,
        lane: StepLane,
        device: torch.device,
        num_threads: int | None,
        execute: Callable[[ScheduleOutput], RunnerOutput],
    ) -> None:
        self.lane = lane
        self.name = lane.kind.value
        self.device = device
        self.num_threads = num_threads
        self._execute = execute
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"deepinfer-{self.name}")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread_count: int | None = None
        self.busy = BusyMeter()
        self.wakeup = asyncio.Event()
        self.in_flight = False
        self.borrowing = False
        """True while a step runs on this worker's threads plus its peer's."""
        self.step_done = asyncio.Event()

    @property
    def idle(self) -> bool:
        return not self.in_flight and not self.lane.has_work

    async def run(self, so: ScheduleOutput, borrowed_threads: int = 0) -> RunnerOutput:
        """Run one step on this worker's thread (awaits without blocking the loop), on its own
        share of cores plus `borrowed_threads` of its idle peer's (see `ThreadLending`)."""
        loop = asyncio.get_running_loop()
        num_threads = self.num_threads
        if num_threads is not None:
            num_threads += borrowed_threads
        self.borrowing = borrowed_threads > 0
        self.in_flight = True
        self.step_done.clear()
        try:
            with self.busy.measure():
                return await loop.run_in_executor(self._executor, self._run, so, num_threads)
        finally:
            self.in_flight = False
            self.borrowing = False
            self.step_done.set()

    def _run(self, so: ScheduleOutput, num_threads: int | None) -> RunnerOutput:
        if num_threads is not None and num_threads != self._thread_count:
            torch.set_num_threads(num_threads)
            self._thread_count = num_threads
        if self._stream is None:
            return self._execute(so)
        start = time.perf_counter()
        try:
            with torch.cuda.stream(self._stream):
                out = self._execute(so)
            self._stream.synchronize()
        except Exception:
            self._settle()
            raise
        # a step that samples nothing never waits for the device: time it to completion here
        return dataclasses.replace(out, elapsed_s=time.perf_counter() - start)

    def _settle(self) -> None:
        """After a failed step: wait for the kernels it queued; a device that cannot is lost."""
        assert self._stream is not None
        try:
            self._stream.synchronize()
        except Exception as exc:
            raise FatalEngineError(f"device {self.device} is lost: {exc}") from exc

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The worker's thread, for KV copies that must be ordered with its steps."""
        return self._executor

    def stats(self) -> WorkerStats:
        return WorkerStats(
            name=self.name,
            device=str(self.device),
            num_threads=self.num_threads,
            busy_fraction=self.busy.fraction(),
            num_steps=self.busy.num_steps,
            busy_s_total=self.busy.busy_s_total,
        )

    def shutdown(self) -> None:
        """Wait for the step in flight, then stop the thread (blocking: call off the loop)."""
        self._executor.shutdown(wait=True)


def build_workers(core: EngineCore, config: WorkersConfig) -> tuple[Worker, ...]:
    """One worker per lane of the core's scheduler, on its lane's device group, with its thread
    share (CPU) or stream."""
    device = core.info.device
    num_cores = core.config.runtime.num_threads or torch.get_num_threads()
    if device.type != "cpu":
        shares: tuple[int | None, ...] = (None,) * len(core.lanes)
    elif len(core.lanes) == 1:
        shares = (num_cores,)
    else:
        shares = thread_shares(config, num_cores)
    return tuple(
        Worker(lane, core.lane_device(lane.kind), n, core.execute)
        for lane, n in zip(core.lanes, shares, strict=True)
    )


class ThreadLending:
    """Which worker may borrow which idle worker's CPU threads for a step: with two workers
    and lending on, each is the other's peer; otherwise nobody lends.

    A step on borrowed threads marks its worker `borrowing` until it ends; the peer waits for
    that (`wait_for_peer`) before it starts a step of its own, so the cores are never
    oversubscribed."""

    def __init__(self, workers: tuple[Worker, ...], enabled: bool) -> None:
        self._peers: dict[int, Worker] = {}
        if enabled and len(workers) == 2:
            first, second = workers
            self._peers = {id(first): second, id(second): first}

    def peer(self, worker: Worker) -> Worker | None:
        return self._peers.get(id(worker))

    def borrowable(self, worker: Worker) -> int:
        """Threads `worker` may borrow for its next step: its peer's share if the peer is idle
        (both on CPU), else 0."""
        peer = self.peer(worker)
        if peer is None or not peer.idle or worker.num_threads is None:
            return 0
        return peer.num_threads or 0

    async def wait_for_peer(self, worker: Worker) -> None:
        """Until the step that borrowed `worker`'s threads (if one runs) has ended."""
        peer = self.peer(worker)
        if peer is not None and peer.borrowing:
            await peer.step_done.wait()
