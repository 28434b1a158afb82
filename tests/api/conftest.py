"""Live servers for the API tests over the fake engine (fast); the real engine's, shared by every
folder, is `real_server` in tests/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deepinfer.api.app import create_app
from deepinfer.server_config import ServerConfig
from tests.api.fake_engine import FakeEngine
from tests.api.live_server import LiveServer


@pytest.fixture(scope="module")
def fake_server() -> Iterator[LiveServer]:
    engine = FakeEngine()
    server = LiveServer(create_app(engine, ServerConfig(max_body_bytes=64 * 1024))).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def fake_engine(fake_server: LiveServer) -> FakeEngine:
    engine = fake_server.config.app.state.engine
    assert isinstance(engine, FakeEngine)
    return engine
