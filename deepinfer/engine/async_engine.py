"""`AsyncEngine`: the embedding API. Runs on whatever asyncio loop is running (asyncio or uvloop).

    async with AsyncEngine(Config()) as engine:
        async for out in engine.generate([ChatMessage("user", "Hi")], SamplingParams()):
            print(out.text, end="")

One owned task drives the engine: schedule on the loop (pure, fast), run the forward pass on the
engine's single forward thread, apply results on the loop. Aborts are queued and applied between
steps, so blocks are never freed under a running forward pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

from deepinfer.config import Config
from deepinfer.engine.core import EngineCore, RuntimeInfo
from deepinfer.engine.stream import RequestStream
from deepinfer.engine.tiers import check_retention, fill_from_disk, write_behind
from deepinfer.engine.types import EngineStats, GenerationOutput
from deepinfer.errors import (
    ContextLengthError,
    EngineDeadError,
    InvalidRequestError,
    OverloadedError,
)
from deepinfer.outputs import RunnerOutput, TokenDelta
from deepinfer.request import FinishReason, Request, SamplingParams
from deepinfer.scheduler.output import ScheduleOutput
from deepinfer.text.detokenizer import IncrementalDetokenizer
from deepinfer.text.recipe import ChatMessage, ChatRecipe, ReasoningEffort
from deepinfer.text.tokenizer import Tokenizer

log = logging.getLogger("deepinfer.engine")

Prompt = str | Sequence[int] | Sequence[ChatMessage]
_LONG_TEXT_CHARS = 8192
"""Prompts longer than this are tokenized on a worker thread, not on the loop."""


class AsyncEngine:
    def __init__(self, config: Config | None = None, *, core: EngineCore | None = None) -> None:
        self.config = config or Config()
        self._core = core
        self._streams: dict[str, RequestStream] = {}
        self._pending_aborts: set[str] = set()
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._forward = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-forward")
        self._counter = itertools.count()
        self._dead: BaseException | None = None
        self.step_observers: list[Callable[[ScheduleOutput, RunnerOutput], None]] = []
        """Callables `(so, out)` run on the loop after each step (metrics hook)."""

    # -- lifecycle --
    async def start(self) -> None:
        if self._loop_task is not None:
            return
        if self._core is None:
            self._core = await asyncio.to_thread(EngineCore, self.config)
        self._loop_task = asyncio.create_task(self._run(), name="deepinfer-engine-loop")

    async def shutdown(self) -> None:
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for stream in list(self._streams.values()):
            stream.fail(EngineDeadError("the engine is shutting down"))
        self._streams.clear()
        await asyncio.to_thread(self._forward.shutdown, True)
        if self._core is not None:
            await asyncio.to_thread(self._core.close)

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
        return self._loop_task is not None and not self._loop_task.done()

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
            max_model_len=core.info.max_model_len,
            disk=core.disk.stats() if core.disk is not None else None,
        )

    def check_integrity(self) -> None:
        self.core.check_integrity()

    # -- requests --
    async def encode_prompt(
        self, prompt: Prompt, reasoning_effort: ReasoningEffort | None = None
    ) -> list[int]:
        """Token ids for a text prompt, chat messages (through the recipe) or ids as given."""
        if isinstance(prompt, str):
            if len(prompt) > _LONG_TEXT_CHARS:
                return await asyncio.to_thread(self.recipe.encode_prompt, prompt)
            return self.recipe.encode_prompt(prompt)
        items = list(prompt)
        if items and isinstance(items[0], ChatMessage):
            messages = [m for m in items if isinstance(m, ChatMessage)]
            return self.recipe.encode(messages, reasoning_effort=reasoning_effort)
        return self._check_token_ids(items)

    def _check_token_ids(self, items: list[object]) -> list[int]:
        vocab = self.tokenizer.vocab_size
        if not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in items
        ):
            raise InvalidRequestError(
                f"prompt token ids must be integers in [0, {vocab})", param="prompt"
            )
        return [int(t) for t in items]  # type: ignore[call-overload]

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
            raise EngineDeadError("the engine is not running")
        check_retention(cache_retention)
        ids = await self.encode_prompt(prompt, reasoning_effort)
        self._check_admissible(ids, params)
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}-{next(self._counter)}"
        request = Request(
            request_id=rid,
            prompt_token_ids=ids,
            sampling=params,
            eos_token_ids=self.recipe.end_of_turn_ids,
            cache_salt=cache_salt,
            retention=cache_retention,
        )
        request.num_disk_cached_tokens = await fill_from_disk(self.core, self._forward, request)
        stream = RequestStream(
            rid,
            len(ids),
            IncrementalDetokenizer(self.tokenizer),
            params.stop,
            request.stop_token_ids,
            self.abort,
            disk_cached_tokens=request.num_disk_cached_tokens,
        )
        self.core.add_request(request)
        self._streams[rid] = stream
        self._wakeup.set()
        return stream

    def _check_admissible(self, ids: list[int], params: SamplingParams) -> None:
        limit = self.max_model_len
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(ids) + params.max_tokens > limit:
            raise ContextLengthError(len(ids), params.max_tokens, limit)
        if self.core.scheduler.num_waiting >= self.config.scheduler.max_waiting:
            raise OverloadedError("too many requests are waiting; retry shortly", retry_after_s=1)

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
        self._wakeup.set()
        return True

    # -- the loop --
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        try:
            while True:
                self._apply_aborts()
                if not core.has_work:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                so = core.schedule()
                out = await loop.run_in_executor(self._forward, core.execute, so)
                self._apply_aborts()
                self._deliver(core.update(so, out))
                await write_behind(core, self._forward)
                for observer in self.step_observers:
                    observer(so, out)
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("engine loop failed; failing every open request")
            self._dead = exc
            for stream in self._streams.values():
                stream.fail(EngineDeadError(f"engine failed: {exc!r}"))
            self._streams.clear()

    def _apply_aborts(self) -> None:
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
            if stream.push(delta):  # a stop string matched: end the request now
                self._pending_aborts.add(delta.request_id)
            elif delta.finished:
                del self._streams[delta.request_id]


def _abort_delta(request_id: str) -> TokenDelta:
    return TokenDelta(request_id=request_id, token_ids=(), finish_reason=FinishReason.ABORT)
