"""litellm's `completion` on the `openai/` provider: a plain answer, a forced tool call (whole
and streamed) and the tool's result sent back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

litellm = pytest.importorskip("litellm", reason="litellm is not installed (pip install litellm)")

pytestmark = [pytest.mark.slow, pytest.mark.frameworks]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
QUESTION: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(autouse=True)
def _thread_loop() -> Iterator[None]:
    """litellm's blocking `completion` runs its service hooks on the thread's event loop, making
    one (never closed) when there is none; garbage collected in a later test, it fails that test
    with an unclosed-loop warning. Each test here gets a loop that is closed after it."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield
    asyncio.set_event_loop(None)
    loop.close()


def complete(base_url: str, **kwargs: Any) -> Any:
    return litellm.completion(
        model="openai/smollm2", api_base=base_url, api_key="x", temperature=0, num_retries=0,
        **kwargs,
    )  # fmt: skip


def test_plain(base_url: str) -> None:
    r = complete(base_url, max_tokens=32, messages=[{"role": "user", "content": "Hi!"}])
    assert r.choices[0].message.content.strip()
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0


def test_tool_round_trip(base_url: str) -> None:
    r = complete(base_url, max_tokens=64, messages=QUESTION, tools=[WEATHER], tool_choice=NAMED)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    history = [
        *QUESTION,
        r.choices[0].message.model_dump(),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    after = complete(base_url, max_tokens=48, messages=history, tools=[WEATHER])
    message = after.choices[0].message
    assert message.content or message.tool_calls


def test_streamed_tool_call(base_url: str) -> None:
    stream = complete(
        base_url, max_tokens=64, messages=QUESTION, tools=[WEATHER], tool_choice=NAMED, stream=True
    )
    chunks = list(stream)
    built = litellm.stream_chunk_builder(chunks)
    calls = built.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"]
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)
