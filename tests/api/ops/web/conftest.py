"""Headless Chromium (the system's package, /usr/bin/chromium) driven by Playwright, and the
servers the page tests open: the null model (quick, real engine) and a fake engine whose answer
a test chooses. Without Chromium the browser tests are skipped, saying why, unless
DEEPINFER_REQUIRE_BROWSER is set (.ci/run installs Chromium and sets it)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deepinfer.api.app import create_app
from deepinfer.config import CacheConfig, Config, DiskCacheConfig, ModelConfig, SchedulerConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.server_config import ServerConfig
from tests.api.fake_engine import FakeEngine
from tests.api.live_server import LiveServer

CHROMIUM = os.environ.get("DEEPINFER_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
"""The closed network refuses Chromium's own connections: ask it to make none."""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    required = bool(os.environ.get("DEEPINFER_REQUIRE_BROWSER"))
    if not Path(CHROMIUM).exists():
        message = f"no Chromium at {CHROMIUM} (apt-get install chromium)"
        pytest.fail(message) if required else pytest.skip(message)
    from playwright import sync_api

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


class PageErrors:
    """Console errors, uncaught exceptions and CSP violations of a page: a test ends with none."""

    def __init__(self, page: Any) -> None:
        self.messages: list[str] = []
        page.on("pageerror", lambda exc: self.messages.append(f"pageerror: {exc}"))
        page.on("console", self._console)

    def _console(self, message: Any) -> None:
        if message.type == "error":
            self.messages.append(f"console: {message.text}")

    def allowing(self, *fragments: str) -> list[str]:
        return [m for m in self.messages if not any(f in m for f in fragments)]


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.set_default_timeout(20_000)
    page.errors = PageErrors(page)
    try:
        yield page
    finally:
        context.close()


def null_config(**scheduler: Any) -> Config:
    return Config(
        model=ModelConfig(path=Path("null")),
        cache=CacheConfig(kv_memory_bytes=64 << 20),
        disk_cache=DiskCacheConfig(enabled=False),
        scheduler=SchedulerConfig(max_num_seqs=16, **scheduler),
    )


@pytest.fixture(scope="module")
def null_server() -> Iterator[LiveServer]:
    config = null_config()
    server = LiveServer(create_app(AsyncEngine(config), config.server)).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def fake_server() -> Iterator[LiveServer]:
    server = LiveServer(create_app(FakeEngine(), ServerConfig())).start()
    try:
        yield server
    finally:
        server.stop()
