"""Live servers for the API tests: over the fake engine (fast), and over the real engine on
SmolLM2 (slow; one per test session)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine
from live_server import LiveServer

from deepinfer.api.app import create_app
from deepinfer.config import ServerConfig


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


@pytest.fixture(scope="session")
def real_server() -> Iterator[LiveServer]:
    """The real engine on SmolLM2 behind the API, started by the app's lifespan (slow tests)."""
    from deepinfer.config import CacheConfig, Config, ModelConfig, SchedulerConfig, WorkersConfig
    from deepinfer.engine.async_engine import AsyncEngine

    config = Config(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(num_blocks=1024),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024, max_waiting=256),
        # disaggregated (the default), lending idle cores: a lone request uses both
        workers=WorkersConfig(lend_idle_threads=True),
    )
    server = LiveServer(create_app(AsyncEngine(config), config.server)).start(timeout_s=300)
    try:
        yield server
    finally:
        server.stop()
