"""`AsyncEngine`: the embedding API. Runs on whatever asyncio loop is running (asyncio or uvloop).

    async with AsyncEngine(Config()) as engine:
        async for out in engine.generate([ChatMessage("user", "Hi")], SamplingParams()):
            print(out.text, end="")

One owned task per worker drives the engine (`driver.py`, `workers.py`): a prefill and a decode
worker whose steps overlap, or one colocated worker. Each schedules its step on the loop (pure,
fast), runs the forward pass on its own thread, and applies the results on the loop. Aborts are
applied between steps (`stream_table.py`); the scheduler defers those of requests inside a running
step until that step is applied, so blocks are never freed under a forward pass.

One request never takes the engine down: a step that raises (its forward pass or sampling on the
worker's thread, or its update on the loop) fails the requests of that step only (their streams
raise `RequestFailedError`, their blocks are freed), and the worker goes on with its next step;
a delta that cannot be delivered fails its request only. What cannot be recovered (a lost device,
a scheduler left inconsistent, a failed KV handoff) stops the engine: every open stream raises
`EngineDeadError`, and `dead_reason` says why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import uuid
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

from deepinfer.config import Config
from deepinfer.engine.admission import check_admissible, check_sampling_inputs
from deepinfer.engine.core import EngineCore, RuntimeInfo
from deepinfer.engine.driver import EngineDriver, StepObserver
from deepinfer.engine.frame_pacer import FramePacer
from deepinfer.engine.process_settings import ProcessSettings
from deepinfer.engine.prompts import Prompt, encode_prediction, encode_prompt, is_chat
from deepinfer.engine.stream import RequestStream
from deepinfer.engine.stream_table import StreamTable
from deepinfer.engine.types import EngineStats, GenerationOutput, HandoffStats
from deepinfer.engine.workers import ThreadLending, Worker, build_workers
from deepinfer.errors import EngineDeadError
from deepinfer.kv_transfer.params import KVTransferParams
from deepinfer.openmp_env import DEFAULTS as OPENMP_DEFAULTS
from deepinfer.openmp_env import loaded_too_late
from deepinfer.request import Request, SamplingParams
from deepinfer.text.detokenizer import IncrementalDetokenizer
from deepinfer.text.recipe import ChatRecipe, ReasoningEffort
from deepinfer.text.tokenizer import Tokenizer
from deepinfer.tiers.kv_tiers import check_retention
from deepinfer.tiers.stats import DiskSummary

log = logging.getLogger("deepinfer.engine")


class AsyncEngine:
    def __init__(self, config: Config | None = None, *, core: EngineCore | None = None) -> None:
        self.config = config or Config()
        self._core = core
        sched = self.config.scheduler
        pacer = FramePacer(sched.stream_frames_per_step, sched.stream_max_delay_ms / 1e3)
        self._streams = StreamTable(pacer)
        self._workers: tuple[Worker, ...] = ()
        self._driver: EngineDriver | None = None
        """The tasks driving the core, from `start` on."""
        self._kv_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-kv-io")
        """Copies between device blocks and lower tiers (into blocks no step can see yet)."""
        self._counter = itertools.count()
        self._process_settings = ProcessSettings(self.config.workers)
        """The GIL switch interval and the garbage collector's settings while the engine runs."""
        self.step_observers: list[StepObserver] = []
        """Callables `(so, out)` run on the loop after each step (metrics hook)."""

    # -- lifecycle --
    async def start(self) -> None:
        if self._driver is not None:
            return
        if self._core is None:
            self._core = await asyncio.to_thread(EngineCore, self.config)
        tokenizer = self._core.tokenizer
        await asyncio.to_thread(lambda: tokenizer.byte_pieces)  # made once, off the loop
        if self._core.info.device.type == "cpu" and loaded_too_late():
            settings = " ".join(f"{k}={v}" for k, v in OPENMP_DEFAULTS.items())
            log.warning(
                "torch was imported before deepinfer: OpenMP threads wait with libgomp's "
                "defaults, and CPU steps run slower; import deepinfer first or set %s",
                settings,
            )
        workers = self.config.workers
        self._workers = build_workers(self._core, workers)
        lending = ThreadLending(self._workers, workers.lend_idle_threads)
        self._driver = EngineDriver(
            self._core, self._workers, lending, self._streams, self.step_observers
        )
        self._process_settings.apply()
        self._driver.start()
        if self._core.kv_transfer is not None:
            await self._core.kv_transfer.start()

    async def shutdown(self) -> None:
        if self._driver is not None:
            await self._driver.stop()
        self._streams.fail_all(EngineDeadError("the engine is shutting down"))
        for worker in self._workers:
            await asyncio.to_thread(worker.shutdown)
        await asyncio.to_thread(self._kv_io.shutdown, True)
        if self._core is not None and self._core.kv_transfer is not None:
            await self._core.kv_transfer.close()
        if self._core is not None:
            await asyncio.to_thread(self._core.close)
        self._process_settings.restore()

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
        return self._driver is not None and self._driver.is_running

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving after an unrecoverable error; None otherwise."""
        return self._driver.dead_reason if self._driver is not None else None

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

    @property
    def max_waiting(self) -> int:
        """The most requests queued at once (`--max-waiting`)."""
        return self.config.scheduler.max_waiting

    @property
    def system_fingerprint(self) -> str:
        return self.core.info.system_fingerprint

    def stats(self) -> EngineStats:
        core, driver = self.core, self._driver
        usage = core.kv.usage()
        return EngineStats(
            num_waiting=core.scheduler.num_waiting,
            num_running=core.scheduler.num_running,
            num_blocks_total=core.info.num_blocks,
            num_blocks_used=core.kv.num_used_blocks,
            decode_blocks_total=core.info.decode_num_blocks,
            decode_blocks_used=core.decode_kv.num_used_blocks if core.decode_kv else 0,
            window_blocks_total=usage.num_window_blocks,
            window_blocks_used=usage.num_window_used_blocks,
            handoffs=driver.handoffs if driver is not None else HandoffStats(),
            max_model_len=core.info.max_model_len,
            disk=core.tiers.disk_stats(),
            workers=tuple(w.stats() for w in self._workers),
            prefill=core.prefill_stats(),
            host=core.tiers.host_stats(),
            num_failed_steps=driver.num_failed_steps if driver is not None else 0,
            num_failed_requests=self._streams.num_failed_requests,
            prefill_counts=core.scheduler.prefill_counts(),
            speculative=core.scheduler.speculative_counts(),
            expert_load=core.expert_load(),
            expert_parallel=core.experts.snapshot() if core.experts is not None else None,
            kv_events_dropped=core.tiers.kv_events_dropped(),
            kv_transfer=core.kv_transfer.stats() if core.kv_transfer is not None else None,
        )

    async def disk_summary(self) -> DiskSummary | None:
        """The disk tier's contents per retention class (a scan of its index, in a worker
        thread: call it now and then, not per request); None without a disk tier."""
        return await self.core.tiers.disk_summary()

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
        prediction: str | None = None,
        kv_transfer: KVTransferParams | None = None,
    ) -> RequestStream:
        """Validate and enqueue a request; raises before any output if it cannot be served.
        `prediction`: text the output is expected to repeat much of (an edited file), drafted
        from (the output is the same without it). `kv_transfer`: vLLM's `kv_transfer_params`
        (with `--kv-transfer`: keep the prompt's KV for another replica, or pull it from one;
        ignored otherwise)."""
        if not self.is_running:
            reason = self.dead_reason
            raise EngineDeadError("the engine is not running" + (f": {reason}" if reason else ""))
        check_retention(cache_retention)
        if is_chat(prompt):
            params = params.with_turn_stops(self.recipe.turn_stops)
        ids = await self.encode_prompt(prompt, reasoning_effort)
        core = self.core
        waiting, max_waiting = core.scheduler.num_waiting, self.config.scheduler.max_waiting
        check_admissible(ids, params, self.max_model_len, waiting, max_waiting)
        await check_sampling_inputs(params, self.tokenizer.vocab_size, core.constraints)
        predicted = (
            await encode_prediction(self.recipe, prediction, self.max_model_len)
            if prediction
            else ()
        )
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}-{next(self._counter)}"
        request = Request(
            request_id=rid,
            prompt_token_ids=ids,
            sampling=params,
            eos_token_ids=self.recipe.end_of_turn_ids,
            cache_salt=cache_salt,
            retention=cache_retention,
            predicted_token_ids=predicted,
        )
        fill = await self.core.tiers.fill(request, self._kv_io)
        transfer = self.core.kv_transfer
        pulled = 0
        if transfer is not None and kv_transfer is not None:
            pulled = await transfer.pull(request, kv_transfer)
        request = dataclasses.replace(
            request,
            num_host_cached_tokens=fill.host_tokens,
            num_disk_cached_tokens=fill.disk_tokens,
            num_remote_cached_tokens=pulled,
            hold_kv=bool(
                transfer and transfer.produces and kv_transfer and kv_transfer.do_remote_decode
            ),
        )
        stream = RequestStream(
            rid,
            len(ids),
            IncrementalDetokenizer(self.tokenizer, shown_ids=frozenset(params.shown_token_ids)),
            params.stop,
            request.stop_token_ids,
            self.abort,
            disk_cached_tokens=request.num_disk_cached_tokens,
            host_cached_tokens=request.num_host_cached_tokens,
            remote_cached_tokens=request.num_remote_cached_tokens,
            include_stop=params.include_stop_str_in_output,
            num_prediction_tokens=len(predicted),
        )
        self.core.add_request(request)
        self._streams.open(stream)
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
        prediction: str | None = None,
        kv_transfer: KVTransferParams | None = None,
    ) -> AsyncGenerator[GenerationOutput, None]:
        """Submit and stream; cancelling or closing the iterator aborts the request."""
        stream = await self.submit(
            prompt,
            params or SamplingParams(),
            request_id=request_id,
            reasoning_effort=reasoning_effort,
            cache_salt=cache_salt,
            cache_retention=cache_retention,
            prediction=prediction,
            kv_transfer=kv_transfer,
        )
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def kv_transfer_params(self, request_id: str) -> KVTransferParams | None:
        """What a finished `do_remote_decode` request kept for a consumer, as the
        `kv_transfer_params` of its answer (None: nothing kept, or transfers off)."""
        transfer = self.core.kv_transfer
        return transfer.params_for(request_id) if transfer is not None else None

    def abort(self, request_id: str) -> bool:
        """Abort by id; applied before the next step. False if the id is unknown or finished."""
        if not self._streams.request_abort(request_id):
            return False
        self._wake_workers()
        return True

    def _wake_workers(self) -> None:
        if self._driver is not None:
            self._driver.wake()
