"""Agent frameworks, unmodified, against the live server on SmolLM2 (`real_server`, shared with
tests/api): offline (telemetry off, every non-loopback connection refused and recorded)."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator

import pytest

from tests.api.frameworks.offline import Offline
from tests.api.frameworks.recorder import Recorder
from tests.api.live_server import LiveServer

# Read at import by the frameworks: no cost-map download, no tracing or telemetry export.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
os.environ["LANGSMITH_TRACING"] = "false"
os.environ["LANGCHAIN_TRACING_V2"] = "false"
os.environ["LOGFIRE_IGNORE_NO_CONFIG"] = "1"

FRAMEWORKS = ("agents", "pydantic_ai", "langchain_openai", "instructor", "litellm", "dspy")
"""Imported here under the guard, so an import that reaches the network is caught."""

IMPORT_GUARD = Offline()
with IMPORT_GUARD.active():
    for _name in FRAMEWORKS:
        with contextlib.suppress(ImportError):  # the test module skips, naming the package
            importlib.import_module(_name)


@pytest.fixture(autouse=True)
def offline() -> Iterator[Offline]:
    """Each test runs with the network refused; it fails if anything tried to reach it."""
    assert IMPORT_GUARD.attempts == [], f"network at import: {IMPORT_GUARD.attempts}"
    guard = Offline()
    with guard.active():
        yield guard
    assert guard.attempts == [], f"network at run: {guard.attempts}"


@pytest.fixture(scope="session")
def base_url(real_server: LiveServer) -> str:
    """The OpenAI-compatible root (`.../v1`) of the live server."""
    return f"{real_server.url}/v1"


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()
