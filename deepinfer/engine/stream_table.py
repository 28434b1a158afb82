"""The open requests' streams by request id, and the aborts waiting for the next step boundary.

Each step's deltas are routed here to their streams. A request whose stream matched a stop string,
or could not take a delta, is marked for abort; so is one a client aborts. Marked requests are
aborted between steps (`apply_aborts`), never under a forward pass.

Readers are woken as the `FramePacer` says: at every token while a step serves few streams, and
once for several tokens when many streams share quick steps (the event loop's work per frame
would otherwise grow past the step's own time).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from deepinfer.engine.frame_pacer import FramePacer
from deepinfer.engine.stream import RequestStream
from deepinfer.errors import RequestFailedError
from deepinfer.outputs import TokenDelta
from deepinfer.request import FinishReason

log = logging.getLogger("deepinfer.engine")


class StreamTable:
    def __init__(self, pacer: FramePacer | None = None) -> None:
        self._streams: dict[str, RequestStream] = {}
        self._pending_aborts: set[str] = set()
        self._pacer = pacer or FramePacer()
        self._deferred: dict[str, float] = {}
        """Streams holding tokens their reader was not woken for, and since when."""
        self._flush_timer: asyncio.TimerHandle | None = None
        self.num_failed_requests = 0
        """Requests ended with an internal error (their step failed, or delivery did)."""

    def open(self, stream: RequestStream) -> None:
        self._streams[stream.request_id] = stream

    def request_abort(self, request_id: str) -> bool:
        """Mark an open request for abort at the next step boundary; False if the id is unknown
        or finished."""
        if request_id not in self._streams:
            return False
        self._pending_aborts.add(request_id)
        return True

    @property
    def has_pending_aborts(self) -> bool:
        return bool(self._pending_aborts)

    def apply_aborts(self, abort: Callable[[str], object]) -> None:
        """Abort each marked request (`abort` frees what the engine holds for it) and end its
        stream with an abort, unless it already ended."""
        while self._pending_aborts:
            rid = self._pending_aborts.pop()
            abort(rid)
            self._deferred.pop(rid, None)
            stream = self._streams.pop(rid, None)
            if stream is not None and not stream.finished:
                stream.push(_abort_delta(rid))

    def deliver(self, deltas: list[TokenDelta], lane: str = "") -> None:
        """Push each delta of a step of `lane` to its stream and wake its reader as the pacer
        says; a stream that stops (a stop string) or fails to take it has its request marked
        for abort."""
        now = time.monotonic()
        tokens_per_frame = self._pacer.tokens_per_frame(len(deltas), now, lane)
        deferred = self._deferred
        for delta in deltas:
            rid = delta.request_id
            stream = self._streams.get(rid)
            if stream is None:
                continue
            try:
                stopped = stream.push(delta, wake=False)
            except Exception as exc:
                log.error("delivering to request %s failed", rid, exc_info=exc)
                self.fail_request(rid, exc)
                self._pending_aborts.add(rid)  # frees its blocks, if still held
                continue
            if stream.finished or stream.num_unread_tokens >= tokens_per_frame or not stream.woken:
                stream.wake()
                deferred.pop(rid, None)
            elif rid not in deferred:
                deferred[rid] = now
            if stopped:  # a stop string matched: end the request now
                self._pending_aborts.add(rid)
            elif delta.finished:
                del self._streams[rid]
        if deferred:
            self._wake_overdue(now)

    def _wake_overdue(self, now: float) -> None:
        """Wake the readers whose oldest unread token is due, and arm a timer for the rest (a
        request that gets no further step soon is not held back)."""
        due = now - self._pacer.max_delay_s
        overdue = []
        for rid, since in self._deferred.items():  # oldest first (insertion order)
            if since > due:
                break
            overdue.append(rid)
        for rid in overdue:
            self._wake_deferred(rid)
        if self._deferred and self._flush_timer is None:
            loop = asyncio.get_running_loop()
            self._flush_timer = loop.call_later(self._pacer.max_delay_s, self._on_flush_timer)

    def _on_flush_timer(self) -> None:
        self._flush_timer = None
        if self._deferred:
            self._wake_overdue(time.monotonic())

    def _wake_deferred(self, rid: str) -> None:
        del self._deferred[rid]
        stream = self._streams.get(rid)
        if stream is not None:
            stream.wake()

    def fail_request(self, request_id: str, exc: BaseException) -> None:
        """End one request's stream with an internal error (the caller frees its blocks)."""
        self.num_failed_requests += 1
        self._deferred.pop(request_id, None)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.fail(
                RequestFailedError(
                    f"an internal error ({type(exc).__name__}) stopped this request; "
                    "the server serves on, retry it"
                )
            )

    def fail_all(self, error: BaseException) -> None:
        """End every open stream with `error` (the engine stops serving)."""
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()
        self._deferred.clear()
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None


def _abort_delta(request_id: str) -> TokenDelta:
    return TokenDelta(request_id=request_id, token_ids=(), finish_reason=FinishReason.ABORT)
