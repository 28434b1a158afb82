"""`GET /v1/stats` (one JSON snapshot: `stats_schema.Stats`) and `GET /v1/stats/stream` (the same
snapshot as a server-sent event every `interval_s` seconds, default 1, for the dashboard).

A snapshot reads counters the engine and the API keep anyway; the disk tier's per-class summary
scans its index in a worker thread at most every `DISK_SUMMARY_TTL_S` seconds, shared by every
reader, so any number of open dashboards costs the serving path nothing per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from deepinfer.api.context import ApiContext
from deepinfer.api.http.errors import ApiError, ErrorKind
from deepinfer.api.http.sse import EventStreamResponse, data_frame
from deepinfer.api.ops.stats_snapshot import snapshot
from deepinfer.tiers.stats import DiskSummary

DISK_SUMMARY_TTL_S = 5.0
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.25, 60.0


class DiskSummaryCache:
    """The engine's `disk_summary()` (when it has one), read again once older than `ttl_s`; one
    scan at a time however many readers ask."""

    def __init__(self, engine: Any, ttl_s: float = DISK_SUMMARY_TTL_S) -> None:
        self._read: Callable[[], Awaitable[DiskSummary | None]] | None = getattr(
            engine, "disk_summary", None
        )
        self._ttl_s = ttl_s
        self._value: DiskSummary | None = None
        self._read_at = -float("inf")
        self._lock = asyncio.Lock()

    async def get(self) -> DiskSummary | None:
        if self._read is None:
            return None
        async with self._lock:
            if time.monotonic() - self._read_at >= self._ttl_s:
                self._value = await self._read()
                self._read_at = time.monotonic()
        return self._value


def stats_routes(ctx: ApiContext, closing: asyncio.Event) -> list[BaseRoute]:
    """The routes; a stats stream ends when `closing` is set (the server shuts down)."""
    disk = DiskSummaryCache(ctx.engine)

    async def encoded() -> bytes:
        return msgspec.json.encode(snapshot(ctx, await disk.get()))

    async def stats(request: Request) -> Response:
        ctx.check_running()
        return Response(await encoded(), media_type="application/json")

    async def stream(request: Request) -> Response:
        ctx.check_running()
        interval_s = _interval(request.query_params.get("interval_s"))

        async def frames() -> AsyncIterator[bytes]:
            while ctx.engine.is_running and not closing.is_set():
                yield b"data: " + await encoded() + b"\n\n"
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(closing.wait(), interval_s)
            if not closing.is_set():
                error = {"message": "the engine stopped", "type": "unavailable"}
                yield data_frame({"error": error})

        return EventStreamResponse(frames(), _nothing)

    return [
        Route("/v1/stats", stats, methods=["GET"]),
        Route("/v1/stats/stream", stream, methods=["GET"]),
    ]


def _interval(text: str | None) -> float:
    if text is None:
        return 1.0
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not MIN_INTERVAL_S <= value <= MAX_INTERVAL_S:
        raise ApiError(
            ErrorKind.INVALID_REQUEST,
            f"interval_s must be a number of seconds in [{MIN_INTERVAL_S}, {MAX_INTERVAL_S}], "
            f"got {text!r}",
            param="interval_s",
        )
    return value


async def _nothing() -> None:
    """A stats stream holds no engine request: nothing to abort when it closes."""
