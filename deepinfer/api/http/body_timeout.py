"""`BodyTimeoutMiddleware`: a request body that stalls between two reads, or that arrives slower
than a minimum rate once its grace period is over, is answered 408 and its connection closed; a
client that leaves mid-body is logged in one line (the app's part of connection hygiene;
`connections.py` has the server's)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepinfer.api.http.auth import route_path
from deepinfer.api.http.errors import ApiError, ErrorKind, error_response_for

log = logging.getLogger("deepinfer.api")


@dataclass(frozen=True)
class BodyDeadlines:
    """How long a request body may take: `stall_s` between two reads, and in all
    `grace_s + received bytes / min_rate_bytes_per_s` from the moment the app is called."""

    stall_s: float
    grace_s: float
    min_rate_bytes_per_s: float


class BodyTimeoutMiddleware:
    """Answers 408 (in the route's error envelope) and closes the connection when a request body
    misses one of its `deadlines`. Only reads of an unfinished body are timed: once the body is
    whole, `receive` waits for a disconnect (as streaming responses do) unbounded."""

    def __init__(self, app: ASGIApp, deadlines: BodyDeadlines) -> None:
        self.app = app
        self.deadlines = deadlines

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        reads = _BodyReads(scope, receive, send, self.deadlines)
        try:
            async with asyncio.timeout(None) as reads.deadline:
                await self.app(scope, reads.receive, reads.send)
        except TimeoutError:
            if not reads.deadline.expired():
                raise
            await reads.answer_timeout(scope)
        finally:
            reads.body_done = True


class _BodyReads:
    """One request's `receive` and `send` seen by the app: each read of the body runs under the
    earlier of its two deadlines (rescheduled per read, cleared when it returns); `send` notes
    whether a response started."""

    deadline: asyncio.Timeout

    def __init__(self, scope: Scope, receive: Receive, send: Send, limits: BodyDeadlines) -> None:
        self._scope = scope
        self._receive = receive
        self._send = send
        self._limits = limits
        self._loop = asyncio.get_running_loop()
        self._start_s = self._loop.time()
        self._num_received_bytes = 0
        self._too_slow = False
        self.body_done = False
        self.response_started = False

    async def receive(self) -> Message:
        if self.body_done:
            return await self._receive()
        stall_at_s = self._loop.time() + self._limits.stall_s
        rate_at_s = (
            self._start_s
            + self._limits.grace_s
            + self._num_received_bytes / self._limits.min_rate_bytes_per_s
        )
        self._too_slow = rate_at_s < stall_at_s
        self.deadline.reschedule(min(stall_at_s, rate_at_s))
        try:
            message = await self._receive()
        finally:
            if not self.deadline.expired():
                self.deadline.reschedule(None)
        if message["type"] == "http.disconnect":
            self._log_disconnect()
        self._num_received_bytes += len(message.get("body", b""))
        self.body_done = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.response_started = True
        await self._send(message)

    def _log_disconnect(self) -> None:
        """One line for a client gone mid-body: an expected event (the route answers 499 to
        nobody), not a server error."""
        client = self._scope.get("client")
        log.info(
            "client %s disconnected mid-body (%s %s, body bytes read: %d)",
            f"{client[0]}:{client[1]}" if client else "?",
            self._scope.get("method", "?"),
            route_path(self._scope),
            self._num_received_bytes,
        )

    async def answer_timeout(self, scope: Scope) -> None:
        """408 with `connection: close`; with a response already started, nothing can be said and
        uvicorn closes the connection of an unfinished response."""
        message = self._timeout_message()
        log.debug("answering 408: %s", message)
        if self.response_started:
            return
        err = ApiError(ErrorKind.INVALID_REQUEST, message, code="request_timeout")
        response = error_response_for(route_path(scope), err)
        response.status_code = 408
        response.headers["connection"] = "close"
        await response(scope, self._receive, self._send)

    def _timeout_message(self) -> str:
        if self._too_slow:
            return (
                f"the request body arrived slower than {self._limits.min_rate_bytes_per_s:g} "
                f"bytes/s after its first {self._limits.grace_s:g} s "
                f"({self._num_received_bytes} bytes in "
                f"{self._loop.time() - self._start_s:.1f} s)"
            )
        return f"the request body stalled for more than {self._limits.stall_s:g} s"
