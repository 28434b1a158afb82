"""Clients of the FakeEngine server shared by the tool tests; the modules that talk to the real
model define their own `oai` and `claude` on `real_server`, which take precedence."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from tests.api.fake_engine import REPLY, FakeEngine
from tests.api.live_server import LiveServer


@pytest.fixture
def reply(fake_engine: FakeEngine) -> Iterator[FakeEngine]:
    """Lets a test script the answer; the default reply comes back after it."""
    yield fake_engine
    fake_engine.reply = REPLY


@pytest.fixture(scope="module")
def oai(fake_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{fake_server.url}/v1", api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def claude(fake_server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=fake_server.url, api_key="x", max_retries=0) as c:
        yield c
