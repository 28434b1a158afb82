"""`BodyTimeoutMiddleware`: a request body that stalls between two reads is answered 408 and its
connection closed (the app's part of connection hygiene; `connections.py` has the server's)."""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepinfer.api.auth import route_path
from deepinfer.api.errors import ApiError, ErrorKind, error_response_for

log = logging.getLogger("deepinfer.api")


class BodyTimeoutMiddleware:
    """Answers 408 (in the route's error envelope) and closes the connection when a request body
    stalls for `timeout_s` between two reads. Only reads of an unfinished body are timed: once
    the body is whole, `receive` waits for a disconnect (as streaming responses do) unbounded."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        reads = _BodyReads(receive, send, self.timeout_s)
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
    deadline (rescheduled per read, cleared when it returns); `send` notes whether a response
    started."""

    deadline: asyncio.Timeout

    def __init__(self, receive: Receive, send: Send, timeout_s: float) -> None:
        self._receive = receive
        self._send = send
        self._timeout_s = timeout_s
        self.body_done = False
        self.response_started = False

    async def receive(self) -> Message:
        if self.body_done:
            return await self._receive()
        self.deadline.reschedule(asyncio.get_running_loop().time() + self._timeout_s)
        try:
            message = await self._receive()
        finally:
            if not self.deadline.expired():
                self.deadline.reschedule(None)
        self.body_done = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.response_started = True
        await self._send(message)

    async def answer_timeout(self, scope: Scope) -> None:
        """408 with `connection: close`; with a response already started, nothing can be said and
        uvicorn closes the connection of an unfinished response."""
        log.debug("answering 408: the request body stalled for %g s", self._timeout_s)
        if self.response_started:
            return
        err = ApiError(
            ErrorKind.INVALID_REQUEST,
            f"the request body stalled for more than {self._timeout_s:g} s",
            code="request_timeout",
        )
        response = error_response_for(route_path(scope), err)
        response.status_code = 408
        response.headers["connection"] = "close"
        await response(scope, self._receive, self._send)
