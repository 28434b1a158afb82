"""`AsyncEngine`: the embedding API. Runs on whatever asyncio loop is running (asyncio or uvloop).

    async with AsyncEngine(Config()) as engine:
        async for out in engine.generate([ChatMessage("user", "Hi")], SamplingParams()):
            print(out.text, end="")

One owned task per worker drives the engine (`workers.py`): a prefill and a decode worker whose
steps overlap, or one colocated worker. Each schedules its step on the loop (pure, fast), runs the
forward pass on its own thread, and applies the results on the loop. Aborts are applied between
steps; the scheduler defers those of requests inside a running step until that step is applied,
so blocks are never freed under a forward pass.

One request never takes the engine down: a step that raises (its forward pass or sampling on the
worker's thread, or its update on the loop) fails the requests of that step only (their streams
raise `RequestFailedError`, their blocks are freed), and the worker goes on with its next step;
a delta that cannot be delivered fails its request only. What cannot be recovered (a lost device,
a scheduler left inconsistent, a failed KV handoff) stops the engine: every open stream raises
`EngineDeadError`, and `dead_reason` says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

from deepinfer.config import Config
from deepinfer.engine.admission import check_admissible, check_sampling_inputs
from deepinfer.engine.core import EngineCore, RuntimeInfo
from deepinfer.engine.prompts import Prompt, encode_prompt
from deepinfer.engine.stream import RequestStream
from deepinfer.engine.tiers import check_retention, fill_from_lower_tiers, write_behind
from deepinfer.engine.types import EngineStats, GenerationOutput, HandoffStats
from deepinfer.engine.workers import Worker, build_workers
from deepinfer.errors import (
    EngineDeadError,
    FatalEngineError,
    RequestFailedError,
)
from deepinfer.outputs import RunnerOutput, TokenDelta
from deepinfer.request import FinishReason, Request, SamplingParams
from deepinfer.scheduler.lanes import StepLane
from deepinfer.scheduler.output import ScheduleOutput
from deepinfer.text.detokenizer import IncrementalDetokenizer
from deepinfer.text.recipe import ChatRecipe, ReasoningEffort
from deepinfer.text.tokenizer import Tokenizer

log = logging.getLogger("deepinfer.engine")


class AsyncEngine:
    def __init__(self, config: Config | None = None, *, core: EngineCore | None = None) -> None:
        self.config = config or Config()
        self._core = core
        self._streams: dict[str, RequestStream] = {}
        self._pending_aborts: set[str] = set()
        self._workers: tuple[Worker, ...] = ()
        self._tasks: list[asyncio.Task[None]] = []
        self._kv_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-kv-io")
        """Copies between device blocks and lower tiers (into blocks no step can see yet)."""
        self._transfer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-kv-xfer")
        """KV copies from the prefill pool to the decode pool (separate device groups)."""
        self._handoff_wakeup = asyncio.Event()
        self._handoffs = HandoffStats()
        self._counter = itertools.count()
        self._saved_switch_interval: float | None = None
        self._dead: BaseException | None = None
        self._num_failed_steps = 0
        self._num_failed_requests = 0
        self.step_observers: list[Callable[[ScheduleOutput, RunnerOutput], None]] = []
        """Callables `(so, out)` run on the loop after each step (metrics hook)."""

    # -- lifecycle --
    async def start(self) -> None:
        if self._tasks:
            return
        if self._core is None:
            self._core = await asyncio.to_thread(EngineCore, self.config)
        self._workers = build_workers(self._core, self.config.workers)
        if (interval_ms := self.config.workers.gil_switch_interval_ms) is not None:
            self._saved_switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(interval_ms / 1e3)
        self._tasks = [
            asyncio.create_task(self._run(w), name=f"deepinfer-{w.name}") for w in self._workers
        ]
        if self._core.decode_kv is not None:
            self._tasks.append(asyncio.create_task(self._run_handoffs(), name="deepinfer-handoff"))

    async def shutdown(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for stream in list(self._streams.values()):
            stream.fail(EngineDeadError("the engine is shutting down"))
        self._streams.clear()
        for worker in self._workers:
            await asyncio.to_thread(worker.shutdown)
        await asyncio.to_thread(self._kv_io.shutdown, True)
        await asyncio.to_thread(self._transfer.shutdown, True)
        if self._core is not None:
            await asyncio.to_thread(self._core.close)
        if self._saved_switch_interval is not None:
            sys.setswitchinterval(self._saved_switch_interval)
            self._saved_switch_interval = None

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()

    # -- properties --
    @property
    def core(self) -> EngineCore:
        if self._core is None:
            raise EngineDeadError("the engine is not started: use `async with AsyncEngine(...)`")
        return self._core

    @property
    def is_running(self) -> bool:
        return bool(self._tasks) and self._dead is None and not any(t.done() for t in self._tasks)

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving after an unrecoverable error; None otherwise."""
        if self._dead is None:
            return None
        return f"{type(self._dead).__name__}: {self._dead}"

    @property
    def info(self) -> RuntimeInfo:
        return self.core.info

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.tokenizer

    @property
    def recipe(self) -> ChatRecipe:
        return self.core.recipe

    @property
    def model_name(self) -> str:
        return self.core.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.core.info.max_model_len

    def stats(self) -> EngineStats:
        core = self.core
        return EngineStats(
            num_waiting=core.scheduler.num_waiting,
            num_running=core.scheduler.num_running,
            num_blocks_total=core.info.num_blocks,
            num_blocks_used=core.kv.num_used_blocks,
            decode_blocks_total=core.info.decode_num_blocks,
            decode_blocks_used=core.decode_kv.num_used_blocks if core.decode_kv else 0,
            handoffs=self._handoffs,
            max_model_len=core.info.max_model_len,
            disk=core.disk.stats() if core.disk is not None else None,
            workers=tuple(w.stats() for w in self._workers),
            prefill=core.prefill_stats(),
            host=core.host.stats() if core.host is not None else None,
            num_failed_steps=self._num_failed_steps,
            num_failed_requests=self._num_failed_requests,
        )

    def check_integrity(self) -> None:
        self.core.check_integrity()

    # -- requests --
    async def encode_prompt(
        self, prompt: Prompt, reasoning_effort: ReasoningEffort | None = None
    ) -> list[int]:
        """Token ids for a text prompt, chat messages (through the recipe) or ids as given; a
        prompt whose size alone exceeds the context is refused before it is tokenized."""
        return await encode_prompt(self.recipe, prompt, reasoning_effort, self.max_model_len)

    async def submit(
        self,
        prompt: Prompt,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        reasoning_effort: ReasoningEffort | None = None,
        cache_salt: str | None = None,
        cache_retention: str | None = None,
    ) -> RequestStream:
        """Validate and enqueue a request; raises before any output if it cannot be served."""
        if self._dead is not None or not self.is_running:
            reason = self.dead_reason
            raise EngineDeadError("the engine is not running" + (f": {reason}" if reason else ""))
        check_retention(cache_retention)
        ids = await self.encode_prompt(prompt, reasoning_effort)
        core = self.core
        waiting, max_waiting = core.scheduler.num_waiting, self.config.scheduler.max_waiting
        check_admissible(ids, params, self.max_model_len, waiting, max_waiting)
        await check_sampling_inputs(params, self.tokenizer.vocab_size, core.constraints)
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}-{next(self._counter)}"
        request = Request(
            request_id=rid,
            prompt_token_ids=ids,
            sampling=params,
            eos_token_ids=self.recipe.end_of_turn_ids,
            cache_salt=cache_salt,
            retention=cache_retention,
        )
        fill = await fill_from_lower_tiers(self.core, self._kv_io, request)
        request.num_host_cached_tokens = fill.host_tokens
        request.num_disk_cached_tokens = fill.disk_tokens
        stream = RequestStream(
            rid,
            len(ids),
            IncrementalDetokenizer(self.tokenizer),
            params.stop,
            request.stop_token_ids,
            self.abort,
            disk_cached_tokens=request.num_disk_cached_tokens,
            host_cached_tokens=request.num_host_cached_tokens,
        )
        self.core.add_request(request)
        self._streams[rid] = stream
        self._wake_workers()
        return stream

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        reasoning_effort: ReasoningEffort | None = None,
        cache_salt: str | None = None,
        cache_retention: str | None = None,
    ) -> AsyncIterator[GenerationOutput]:
        """Submit and stream; cancelling or closing the iterator aborts the request."""
        stream = await self.submit(
            prompt,
            params or SamplingParams(),
            request_id=request_id,
            reasoning_effort=reasoning_effort,
            cache_salt=cache_salt,
            cache_retention=cache_retention,
        )
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> bool:
        """Abort by id; applied before the next step. False if the id is unknown or finished."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        self._pending_aborts.add(request_id)
        self._wake_workers()
        return True

    # -- the workers' loops --
    def _wake_workers(self) -> None:
        for worker in self._workers:
            worker.wakeup.set()
        self._handoff_wakeup.set()

    async def _run_handoffs(self) -> None:
        """Separate device groups: run the KV copies the scheduler orders, one at a time on the
        transfer thread, and let decode admit each request once its copy is complete."""
        core = self.core
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
                    self._wake_workers()
                    self._handoffs = self._handoffs.add(
                        len(handoff.dst_block_ids), time.perf_counter() - start
                    )
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("engine KV handoff failed; failing every open request")
            self._fail_all(exc)

    async def _run(self, worker: Worker) -> None:
        core = self.core
        try:
            while True:
                self._apply_aborts()
                worker.wakeup.clear()
                if not worker.lane.has_work:
                    await worker.wakeup.wait()
                    continue
                peer = worker.peer
                if peer is not None and peer.borrowing:
                    await peer.step_done.wait()
                so = worker.lane.schedule()
                if so.is_empty:  # e.g. no room to admit: retry when something changes
                    core.update(worker.lane, so, RunnerOutput(step=so.step))
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
            out = await worker.run(so, worker.threads(self.config.workers.lend_idle_threads))
        except FatalEngineError:
            raise
        except Exception as exc:
            self._fail_step(worker.lane, so, exc)
        else:
            self._apply_aborts()
            try:
                deltas = self.core.update(worker.lane, so, out)
            except Exception as exc:
                self._fail_step(worker.lane, so, exc)
            else:
                self._deliver(deltas)
                for observer in self.step_observers:
                    observer(so, out)
        self._wake_workers()
        await write_behind(self.core, worker.executor)

    def _fail_step(self, lane: StepLane, so: ScheduleOutput, exc: Exception) -> None:
        """Finish the failed step's requests and end their streams with an error. Raises
        `FatalEngineError` when the scheduler cannot be made consistent again."""
        log.error("engine %s step %d failed", lane.kind.value, so.step, exc_info=exc)
        try:
            failed = self.core.fail(lane, so)
        except Exception as broken:
            raise FatalEngineError(
                f"the scheduler is inconsistent after a failed {lane.kind.value} step "
                f"({type(exc).__name__}: {exc}): {broken!r}"
            ) from broken
        self._num_failed_steps += 1
        for rid in failed:
            self._fail_request(rid, exc)

    def _fail_request(self, request_id: str, exc: BaseException) -> None:
        """End one request's stream with an internal error (the caller frees its blocks)."""
        self._num_failed_requests += 1
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.fail(
                RequestFailedError(
                    f"an internal error ({type(exc).__name__}) stopped this request; "
                    "the server serves on, retry it"
                )
            )

    def _fail_all(self, exc: BaseException) -> None:
        self._dead = exc
        for stream in self._streams.values():
            stream.fail(EngineDeadError(f"engine failed: {exc!r}"))
        self._streams.clear()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    def _apply_aborts(self) -> None:
        if self._pending_aborts:
            self._handoff_wakeup.set()  # freed decode blocks may let a waiting handoff go
        while self._pending_aborts:
            rid = self._pending_aborts.pop()
            self.core.abort(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None and not stream.finished:
                stream.push(_abort_delta(rid))

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            try:
                stopped = stream.push(delta)
            except Exception as exc:
                log.error("delivering to request %s failed", delta.request_id, exc_info=exc)
                self._fail_request(delta.request_id, exc)
                self._pending_aborts.add(delta.request_id)  # frees its blocks, if still held
                continue
            if stopped:  # a stop string matched: end the request now
                self._pending_aborts.add(delta.request_id)
            elif delta.finished:
                del self._streams[delta.request_id]


def _abort_delta(request_id: str) -> TokenDelta:
    return TokenDelta(request_id=request_id, token_ids=(), finish_reason=FinishReason.ABORT)
