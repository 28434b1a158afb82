"""The open requests' streams by request id, and the aborts waiting for the next step boundary.

Each step's deltas are routed here to their streams. A request whose stream matched a stop string,
or could not take a delta, is marked for abort; so is one a client aborts. Marked requests are
aborted between steps (`apply_aborts`), never under a forward pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from deepinfer.engine.stream import RequestStream
from deepinfer.errors import RequestFailedError
from deepinfer.outputs import TokenDelta
from deepinfer.request import FinishReason

log = logging.getLogger("deepinfer.engine")


class StreamTable:
    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}
        self._pending_aborts: set[str] = set()
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
            stream = self._streams.pop(rid, None)
            if stream is not None and not stream.finished:
                stream.push(_abort_delta(rid))

    def deliver(self, deltas: list[TokenDelta]) -> None:
        """Push each delta to its stream; a stream that stops (a stop string) or fails to take
        it has its request marked for abort."""
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            try:
                stopped = stream.push(delta)
            except Exception as exc:
                log.error("delivering to request %s failed", delta.request_id, exc_info=exc)
                self.fail_request(delta.request_id, exc)
                self._pending_aborts.add(delta.request_id)  # frees its blocks, if still held
                continue
            if stopped:  # a stop string matched: end the request now
                self._pending_aborts.add(delta.request_id)
            elif delta.finished:
                del self._streams[delta.request_id]

    def fail_request(self, request_id: str, exc: BaseException) -> None:
        """End one request's stream with an internal error (the caller frees its blocks)."""
        self.num_failed_requests += 1
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


def _abort_delta(request_id: str) -> TokenDelta:
    return TokenDelta(request_id=request_id, token_ids=(), finish_reason=FinishReason.ABORT)
