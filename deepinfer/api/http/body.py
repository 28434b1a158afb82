"""Reading request bodies: a size limit enforced while reading, a nesting limit checked on the
raw bytes before decoding, and msgspec decoding whose errors name the offending field.

`BodyTimeoutMiddleware`: a request body that stalls between two reads, or that arrives slower
than a minimum rate once its grace period is over, is answered 408 and its connection closed; a
client that leaves mid-body is logged in one line (the app's part of connection hygiene;
`connections.py` has the server's).
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import TypeVar

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepinfer.api.http.auth import route_path
from deepinfer.api.http.errors import ApiError, ErrorKind, error_response_for

T = TypeVar("T")

_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_QUOTE = ord('"')
_OPEN_ARRAY, _CLOSE_ARRAY, _OPEN_OBJECT, _CLOSE_OBJECT = b"[]{}"


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The whole body, or 413 as soon as Content-Length or the bytes read exceed the limit."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(ErrorKind.INVALID_REQUEST, "Content-Length is not a number")
        if int(declared) > max_body_bytes:
            raise _too_large(max_body_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise _too_large(max_body_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_body_bytes: int) -> ApiError:
    return ApiError(
        ErrorKind.TOO_LARGE,
        f"request body exceeds the limit of {max_body_bytes} bytes",
        code="request_too_large",
    )


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in `body`, brackets inside strings ignored.

    Vectorized over the bytes: a 4 MB body takes milliseconds. Escapes are blanked first (pairs
    of backslashes, then backslash-quote), so every quote left opens or closes a string. Exact
    for valid JSON; for invalid JSON, exact up to the first invalid byte, which is as far as a
    decoder reads."""
    if b'\\"' in body:  # only a quote after a backslash can be escaped
        body = body.replace(b"\\\\", b"  ").replace(b'\\"', b"  ")
    data = np.frombuffer(body, dtype=np.uint8)
    structural = (data == _QUOTE) | (data == _OPEN_ARRAY) | (data == _OPEN_OBJECT)
    kinds = data[structural | (data == _CLOSE_ARRAY) | (data == _CLOSE_OBJECT)]  # in order
    # Outside strings: an even number of quotes so far (uint8 wraps at 256, keeping parity).
    outside = np.cumsum(kinds == _QUOTE, dtype=np.uint8) % 2 == 0
    opens = ((kinds == _OPEN_ARRAY) | (kinds == _OPEN_OBJECT)) & outside
    closes = ((kinds == _CLOSE_ARRAY) | (kinds == _CLOSE_OBJECT)) & outside
    steps = opens.view(np.int8) - closes.view(np.int8)
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


def check_json_depth(body: bytes, max_json_depth: int) -> None:
    """400 naming the limit when `body` nests deeper than `max_json_depth`; cheap when the body
    holds fewer brackets than the limit."""
    if body.count(b"[") + body.count(b"{") <= max_json_depth:
        return
    depth = json_depth(body)
    if depth > max_json_depth:
        raise _too_deep(f"arrays and objects nest {depth} levels deep", max_json_depth)


def _too_deep(what: str, max_json_depth: int) -> ApiError:
    return ApiError(
        ErrorKind.INVALID_REQUEST,
        f"body: {what}; at most {max_json_depth} levels are accepted (server limit max_json_depth)",
        param="body",
    )


def decode_json(body: bytes, type_: type[T], *, max_json_depth: int) -> T:
    """Depth-check, decode and type-check a JSON body; errors become 400 naming the field
    (e.g. `messages[0].role`)."""
    if not body.strip():
        raise ApiError(ErrorKind.INVALID_REQUEST, "the request body is empty; send a JSON object")
    check_json_depth(body, max_json_depth)
    try:
        return msgspec.json.decode(body, type=type_)
    except RecursionError:  # a backstop: the depth check refuses such bodies first
        raise _too_deep("arrays and objects nest too deep to decode", max_json_depth) from None
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH.search(text)
        param = match.group("path") if match else None
        message = text[: match.start()] if match else text
        if param:
            message = f"{param}: {message}"
        raise ApiError(ErrorKind.INVALID_REQUEST, message, param=param or None) from None
    except msgspec.DecodeError as exc:
        raise ApiError(ErrorKind.INVALID_REQUEST, f"malformed JSON body: {exc}") from None


def json_response(payload: object) -> Response:
    """A 200 whose body is `payload` encoded by msgspec (no intermediate dict)."""
    return Response(msgspec.json.encode(payload), media_type="application/json")


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
