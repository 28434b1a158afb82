"""`EngineDriver`: the owned tasks that drive an `EngineCore` from the event loop.

One task per worker: schedule its lane's step on the loop (pure, fast), run the forward pass on
the worker's thread, apply the results on the loop and deliver the deltas. With separate device
groups, one more task runs the KV copies from the prefill pool to the decode pool, one at a time
on the transfer thread. Aborts are applied between steps.

Once the engine is idle a while after working, one more task gives the heap's freed pages back to
the OS (`engine/heap.py`).

A step that raises (its forward pass or sampling, or its update) fails that step's requests only.
What cannot be recovered (a lost device, a scheduler left inconsistent, a failed KV handoff) fails
every open stream with `EngineDeadError` and stops every task; `dead_reason` says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from deepinfer.engine.core import EngineCore
from deepinfer.engine.heap import IdleHeapTrim
from deepinfer.engine.stream_table import StreamTable
from deepinfer.engine.types import HandoffStats
from deepinfer.engine.workers import ThreadLending, Worker
from deepinfer.errors import EngineDeadError, FatalEngineError
from deepinfer.outputs import RunnerOutput
from deepinfer.scheduler.output import ScheduleOutput
from deepinfer.scheduler.protocol import StepLane

log = logging.getLogger("deepinfer.engine")

StepObserver = Callable[[ScheduleOutput, RunnerOutput], None]
"""Called on the loop after each step is applied (a metrics hook)."""


class EngineDriver:
    def __init__(
        self,
        core: EngineCore,
        workers: tuple[Worker, ...],
        lending: ThreadLending,
        streams: StreamTable,
        observers: Sequence[StepObserver],
    ) -> None:
        self._core = core
        self._workers = workers
        self._lending = lending
        self._streams = streams
        self._observers = observers
        self._transfer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-kv-xfer")
        """KV copies from the prefill pool to the decode pool (separate device groups)."""
        self._handoff_wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._dead: BaseException | None = None
        self.handoffs = HandoffStats()
        self.num_failed_steps = 0
        self.heap = IdleHeapTrim(lambda: not any(w.lane.has_work for w in workers))
        """Freed heap given back once idle (see deepinfer.engine.heap)."""

    # -- lifecycle --
    def start(self) -> None:
        """Create the owned tasks (on the running loop)."""
        self._tasks = [
            asyncio.create_task(self._run(w), name=f"deepinfer-{w.name}") for w in self._workers
        ]
        if self._core.decode_kv is not None:
            self._tasks.append(asyncio.create_task(self._run_handoffs(), name="deepinfer-handoff"))
        self._tasks.append(asyncio.create_task(self.heap.run(), name="deepinfer-heap-trim"))

    async def stop(self) -> None:
        """Cancel the tasks and wait for them, then for the copy in flight."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.to_thread(self._transfer.shutdown, True)

    @property
    def is_running(self) -> bool:
        return bool(self._tasks) and self._dead is None and not any(t.done() for t in self._tasks)

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving after an unrecoverable error; None otherwise."""
        if self._dead is None:
            return None
        return f"{type(self._dead).__name__}: {self._dead}"

    def wake(self) -> None:
        """Something changed (a request, an abort, a step): every loop looks again."""
        for worker in self._workers:
            worker.wakeup.set()
        self._handoff_wakeup.set()

    # -- the loops --
    async def _run_handoffs(self) -> None:
        """Run the KV copies the scheduler orders, one at a time on the transfer thread, and let
        decode admit each request once its copy is complete."""
        core = self._core
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._handoff_wakeup.clear()
                handoffs = core.drain_handoffs()
                if not handoffs:
                    await self._handoff_wakeup.wait()
                    continue
                for handoff in handoffs:
                    start = time.perf_counter()
                    await loop.run_in_executor(self._transfer, core.copy_kv, handoff)
                    core.complete_handoff(handoff)
                    self.wake()
                    self.handoffs = self.handoffs.add(
                        len(handoff.dst_block_ids), time.perf_counter() - start
                    )
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("engine KV handoff failed; failing every open request")
            self._fail_all(exc)

    async def _run(self, worker: Worker) -> None:
        try:
            while True:
                self.apply_aborts()
                worker.wakeup.clear()
                if not worker.lane.has_work:
                    await worker.wakeup.wait()
                    continue
                await self._lending.wait_for_peer(worker)
                so = worker.lane.schedule()
                if so.is_empty:  # e.g. no room to admit: retry when something changes
                    self._core.update(worker.lane, so, RunnerOutput(step=so.step))
                    await worker.wakeup.wait()
                    continue
                await self._step(worker, so)
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("engine %s worker failed; failing every open request", worker.name)
            self._fail_all(exc)

    async def _step(self, worker: Worker, so: ScheduleOutput) -> None:
        """Run a step and apply it; if either raises, fail the step's requests only."""
        try:
            out = await worker.run(so, self._lending.borrowable(worker))
        except FatalEngineError:
            raise
        except Exception as exc:
            self._fail_step(worker.lane, so, exc)
        else:
            self.apply_aborts()
            try:
                deltas = self._core.update(worker.lane, so, out)
            except Exception as exc:
                self._fail_step(worker.lane, so, exc)
            else:
                self._streams.deliver(deltas, worker.name)
                for observer in self._observers:
                    observer(so, out)
        self.wake()
        self.heap.stepped()
        await self._core.tiers.write_behind(worker.executor)

    def apply_aborts(self) -> None:
        if self._streams.has_pending_aborts:
            self._handoff_wakeup.set()  # freed decode blocks may let a waiting handoff go
        self._streams.apply_aborts(self._core.abort)

    # -- failures --
    def _fail_step(self, lane: StepLane, so: ScheduleOutput, exc: Exception) -> None:
        """Finish the failed step's requests and end their streams with an error. Raises
        `FatalEngineError` when the scheduler cannot be made consistent again."""
        log.error("engine %s step %d failed", lane.kind.value, so.step, exc_info=exc)
        try:
            failed = self._core.fail(lane, so)
        except Exception as broken:
            raise FatalEngineError(
                f"the scheduler is inconsistent after a failed {lane.kind.value} step "
                f"({type(exc).__name__}: {exc}): {broken!r}"
            ) from broken
        self.num_failed_steps += 1
        for rid in failed:
            self._streams.fail_request(rid, exc)

    def _fail_all(self, exc: BaseException) -> None:
        self._dead = exc
        self._streams.fail_all(EngineDeadError(f"engine failed: {exc!r}"))
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
