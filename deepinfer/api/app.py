"""`create_app(engine)`: the whole HTTP API as one Starlette app, mountable under a prefix.

    app = create_app(AsyncEngine(config), config.server)

Run alone, the app's lifespan starts and stops the engine. Mounted inside a host app (whose
lifespan does not run a mounted app's), the host starts the engine, e.g. with
`engine_lifespan(engine)`; requests answer 503 until it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from deepinfer.api.anthropic.routes import anthropic_routes
from deepinfer.api.context import ApiContext
from deepinfer.api.http.access_log import AccessLogMiddleware
from deepinfer.api.http.auth import ApiKeyMiddleware, route_path
from deepinfer.api.http.body import BodyDeadlines, BodyTimeoutMiddleware
from deepinfer.api.http.cache_options import PromptCacheKeyMiddleware
from deepinfer.api.http.errors import ApiError, ErrorKind, error_response_for
from deepinfer.api.openai.render_routes import render_routes
from deepinfer.api.openai.routes import openai_routes
from deepinfer.api.openai.token_routes import token_routes
from deepinfer.api.ops.metrics import ApiMetrics
from deepinfer.api.ops.pages import page_routes
from deepinfer.api.ops.stats_routes import stats_routes
from deepinfer.api.protocol import EngineClient
from deepinfer.api.responses.routes import responses_routes
from deepinfer.config import DiskCacheConfig
from deepinfer.server_config import ServerConfig

log = logging.getLogger("deepinfer.api")

_HTTP_KINDS = {
    404: ErrorKind.NOT_FOUND,
    405: ErrorKind.METHOD_NOT_ALLOWED,
    413: ErrorKind.TOO_LARGE,
}


@contextlib.asynccontextmanager
async def engine_lifespan(engine: EngineClient) -> AsyncIterator[None]:
    """Start the engine unless it already runs; stop it on exit only if started here."""
    started_here = not engine.is_running
    if started_here:
        await engine.start()
    try:
        yield
    finally:
        if started_here:
            await engine.shutdown()


def create_app(
    engine: EngineClient,
    config: ServerConfig | None = None,
    *,
    disk_cache: DiskCacheConfig | None = None,
) -> Starlette:
    """The API over `engine`. `app.state.metrics` holds this app's metrics (own registry).
    `app.state.closing` (an asyncio.Event) ends the endless streams (`/v1/stats/stream`) when
    set: the server sets it as its graceful shutdown begins, so only requests are waited for.
    `disk_cache` says how long stored Responses live per retention class (None: the defaults)."""
    config = config or ServerConfig()
    closing = asyncio.Event()
    metrics = ApiMetrics(engine)
    _observe_steps(engine, metrics)
    ctx = ApiContext(
        engine=engine,
        metrics=metrics,
        served_model_name=config.served_model_name,
        max_body_bytes=config.max_body_bytes,
        limits=config.limits,
    )

    async def health(request: Request) -> Response:
        if not engine.is_running:
            reason = engine.dead_reason or "the engine is not running"
            body = msgspec.json.encode({"status": "unavailable", "reason": reason})
            return Response(body, 503, media_type="application/json")
        return Response(b'{"status":"ok"}', media_type="application/json")

    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    middleware = [
        Middleware(AccessLogMiddleware, metrics=metrics),
        Middleware(BodyTimeoutMiddleware, deadlines=_body_deadlines(config)),
        Middleware(PromptCacheKeyMiddleware),
    ]
    if config.api_key:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=config.api_key, pages=config.web))
    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
            *openai_routes(ctx),
            *anthropic_routes(ctx),
            *responses_routes(ctx, disk_cache or DiskCacheConfig(), config.stored_responses),
            *token_routes(ctx),
            *render_routes(ctx),
            *stats_routes(ctx, closing),
            *(page_routes() if config.web else ()),
        ],
        middleware=middleware,
        exception_handlers={
            HTTPException: _http_error,
            ApiError: _expected_error,
            ClientDisconnect: _expected_error,
            Exception: _internal_error,
        },
        lifespan=lambda _app: engine_lifespan(engine),
    )
    # No 307 to the slash-less path (clients re-send bodies inconsistently across redirects):
    # a trailing slash gets a 404 naming the route (`_http_error`).
    app.router.redirect_slashes = False
    app.state.metrics = metrics
    app.state.engine = engine
    app.state.closing = closing
    return app


def _body_deadlines(config: ServerConfig) -> BodyDeadlines:
    return BodyDeadlines(
        stall_s=config.body_timeout_s,
        grace_s=config.body_grace_s,
        min_rate_bytes_per_s=config.min_body_rate_bytes_per_s,
    )


def _observe_steps(engine: EngineClient, metrics: ApiMetrics) -> None:
    """Engines with a `step_observers` list (the AsyncEngine) report each step's duration."""
    observers: list[Callable[[Any, Any], None]] | None = getattr(engine, "step_observers", None)
    if observers is None:
        return

    def on_step(schedule: Any, output: Any) -> None:
        elapsed_s = getattr(output, "elapsed_s", None)
        kind = getattr(schedule, "kind", None)
        if elapsed_s:
            metrics.observe_step(float(elapsed_s), getattr(kind, "value", "mixed"))

    observers.append(on_step)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = _HTTP_KINDS.get(exc.status_code, ErrorKind.INVALID_REQUEST)
    path = route_path(request.scope)
    message = f"{exc.detail}: {request.method} {path}"
    if exc.status_code == 404:
        message += _slash_hint(request, path)
    response = error_response_for(path, ApiError(kind, message))
    response.status_code = exc.status_code
    response.headers.update(exc.headers or {})
    return response


def _slash_hint(request: Request, path: str) -> str:
    """For a path that is a route but for trailing slashes: the route to call instead."""
    bare = path.rstrip("/")
    routes = getattr(request.app, "routes", ())
    if bare != path and any(isinstance(r, Route) and r.path == bare for r in routes):
        return f"; the route is {bare} (no trailing slash)"
    return ""


async def _expected_error(request: Request, exc: Exception) -> Response:
    """An `ApiError` (or a client gone mid-body) escaping a route: its own status in the
    route's envelope, handled inside the app, so neither logged as a crash nor counted a 500."""
    return error_response_for(route_path(request.scope), exc)


async def _internal_error(request: Request, exc: Exception) -> Response:
    return error_response_for(route_path(request.scope), exc)
