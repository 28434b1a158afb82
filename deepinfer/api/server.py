"""Run the API server: uvicorn's `Server.serve()` and the engine in one uvloop event loop.

python server.py --model PATH --port 8000        # or: deepinfer serve ...
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from deepinfer.api.app import create_app
from deepinfer.api.http.connections import http_protocol
from deepinfer.config import Config

log = logging.getLogger("deepinfer.api")


def serve(config: Config) -> None:
    """Serve `config` on a new uvloop loop (plain asyncio where uvloop is missing); blocks."""
    # uvicorn shuts down gracefully on SIGINT, then re-raises it: that is a normal exit here.
    with (
        contextlib.suppress(KeyboardInterrupt),
        asyncio.Runner(loop_factory=_loop_factory()) as runner,
    ):
        runner.run(serve_async(config))


async def serve_async(config: Config) -> None:
    """Serve on the running loop: the engine starts in the app's lifespan, in this same loop."""
    from deepinfer.engine.async_engine import AsyncEngine

    engine = AsyncEngine(config)
    app = create_app(engine, config.server, disk_cache=config.disk_cache)
    server = _Server(uvicorn_config(app, config), app.state.closing)
    await server.serve()


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when its graceful shutdown begins (`closing`), so the
    endless streams end at once instead of holding the shutdown to its timeout."""

    def __init__(self, config: uvicorn.Config, closing: asyncio.Event) -> None:
        super().__init__(config)
        self._closing = closing

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._closing.set()
        await super().shutdown(sockets)


def uvicorn_config(app: object, config: Config) -> uvicorn.Config:
    """uvicorn settings: our loop (loop="none"), our access log, lifespan on, and the connection
    limits of `config.server`: deadlines for request heads and idle keep-alive, and a cap on
    connections (uvicorn counts the asking connection, hence the + 1) that the protocol shares
    out among client addresses. The body deadlines are the app's own (`create_app`)."""
    s = config.server
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=s.host,
        port=s.port,
        http=http_protocol(s.header_timeout_s, s.max_connections),
        # annotated int, but only ever handed to loop.call_later: fractions work
        timeout_keep_alive=s.keep_alive_timeout_s,  # type: ignore[arg-type]
        limit_concurrency=s.max_connections + 1,
        loop="none",
        lifespan="on",
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=5,
    )


def _loop_factory():  # type: ignore[no-untyped-def]
    try:
        import uvloop
    except ImportError:  # e.g. Windows
        log.warning("uvloop is not installed; using the default asyncio loop")
        return None
    return uvloop.new_event_loop
