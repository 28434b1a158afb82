"""Server-sent events: frame encoding, and an ASGI response that races the body against the
client's disconnect so an abandoned request is aborted at once (not at the next write)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("deepinfer.api")

T = TypeVar("T")

DONE_FRAME = b"data: [DONE]\n\n"


def data_frame(payload: Any) -> bytes:
    """`data: <json>` ended by a blank line (JSON never contains a raw newline)."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def event_frame(event: str, payload: Any) -> bytes:
    """A named event (Anthropic style): `event: <name>` then `data: <json>`, then a blank line."""
    return b"event: " + event.encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client has gone (call only after the request body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run `work` unless the client disconnects first, in which case `work` is cancelled.

    Returns (True, result) when the work finished, (False, None) when the client went away.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        return False, None
    return True, task.result()


class EventStreamResponse(Response):
    """Stream SSE frames; on disconnect, stop reading `frames` and call `on_close` (which aborts
    the engine requests). `on_close` runs exactly once whatever the outcome."""

    media_type = "text/event-stream"

    def __init__(
        self,
        frames: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status_code=200)
        self._frames = frames
        self._on_close = on_close
        self._sse_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self._sse_headers})
            finished, _ = await unless_disconnected(receive, self._pump(send))
            if finished:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose = getattr(self._frames, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
            finally:
                await self._on_close()

    async def _pump(self, send: Send) -> None:
        async for frame in self._frames:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
