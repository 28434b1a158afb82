"""A request's path through the API: the modules of `deepinfer/api` a streamed chat request runs
code in, from the socket to the engine's `submit`, on a server built as `deepinfer serve` builds
it. The path is short and readable in order (docs/architecture.md walks it); a plain request (no
tools, no structured output) never enters the tool machinery."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import httpx
import pytest

import deepinfer.api
from deepinfer.api.app import create_app
from deepinfer.api.server import uvicorn_config
from deepinfer.config import Config
from deepinfer.server_config import ServerConfig
from tests.api.fake_engine import FakeEngine
from tests.api.live_server import LiveServer

API = Path(deepinfer.api.__file__).resolve().parent
MAX_MODULES = 13
"""The two HTTP middlewares every request passes (access log, body bounds), the protocol's route,
schemas and conversion, the shared request context and limits, the refusal of unsupported fields,
how the prompt ends and whether the model thinks (prompt options, the reasoning plan), the
structured-output fields read (none set), the tenant's cache options and the API key they derive
from."""
TOOL_MACHINERY = ("openai/tools.py", "tools/plan.py", "tools/grammar.py")
"""Tool planning and the tools' grammar: entered only by requests that declare tools."""


class PathRecorder:
    """Records, in first-seen order, the API modules whose code runs on behalf of one request:
    calls whose stack reaches uvicorn's request cycle (so the engine's step callbacks, which run
    on the same loop, are not counted), up to the engine's `submit`."""

    def __init__(self) -> None:
        self.modules: list[str] = []
        self.reached_engine = False
        self.on = False

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or not self.on or self.reached_engine:
            return
        code = frame.f_code
        if code.co_name == "submit" and code.co_filename.endswith("fake_engine.py"):
            self.reached_engine = True
            return
        path = Path(code.co_filename)
        if not path.is_relative_to(API) or not _in_request(frame):
            return
        module = path.relative_to(API).as_posix()
        if module not in self.modules:
            self.modules.append(module)


def _in_request(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "run_asgi":
            return True
        frame = frame.f_back
    return False


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    settings = ServerConfig()
    app = create_app(FakeEngine(), settings)
    live = LiveServer(config=uvicorn_config(app, Config(server=settings))).start()
    try:
        yield live
    finally:
        live.stop()


def _path_of(server: LiveServer, body: dict[str, object]) -> list[str]:
    recorder = PathRecorder()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        r.read()  # once before recording: nothing lazily imported or first-time is counted
    server.call(lambda: sys.setprofile(recorder))  # the server's thread: where requests run
    try:
        recorder.on = True
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            r.read()
    finally:
        recorder.on = False
        server.call(lambda: sys.setprofile(None))
    assert recorder.reached_engine
    return recorder.modules


def test_a_streamed_chat_passes_a_handful_of_modules(server: LiveServer) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    modules = _path_of(server, {**body, "max_tokens": 4})
    assert modules[0] == "http/access_log.py" and "openai/routes.py" in modules
    assert not [m for m in modules if m in TOOL_MACHINERY], modules
    assert len(modules) <= MAX_MODULES, " ".join(modules)


def test_tools_enter_the_tool_machinery(server: LiveServer) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    modules = _path_of(server, {**body, "max_tokens": 4, "tools": [tool]})
    assert "openai/tools.py" in modules and "tools/plan.py" in modules
