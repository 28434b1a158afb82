"""Run an ASGI app under uvicorn on 127.0.0.1 (port 0) in a background thread with its own loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import uvicorn

T = TypeVar("T")


class LiveServer:
    """Serves `app` with test settings, or exactly as a ready `config` says (give one or the
    other; a config must leave the loop to the server: loop="none")."""

    def __init__(self, app: Any = None, *, config: uvicorn.Config | None = None) -> None:
        if (app is None) == (config is None):
            raise ValueError("give LiveServer an app or a uvicorn.Config, not both")
        self.config = config or uvicorn.Config(
            app, host="127.0.0.1", port=0, loop="none", lifespan="on", log_config=None,
            access_log=False, timeout_graceful_shutdown=2,
        )  # fmt: skip
        self.server = uvicorn.Server(self.config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="live-server", daemon=True)

    def _main(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.server.serve())
        self.loop.close()

    def start(self, timeout_s: float = 60.0) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the live server did not start")
            time.sleep(0.01)
        return self

    @property
    def port(self) -> int:
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the server's loop (engine state is only touched from there)."""
        assert self.loop is not None

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=30)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the live server did not stop"
