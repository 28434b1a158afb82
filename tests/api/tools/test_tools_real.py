"""Tool round trips on the real model (SmolLM2): 200 whatever the model chooses to do, and
under `auto` every call it writes is one of the declared tools with arguments that parse (valid
for the schema of a strict tool), sampled with many seeds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.api.live_server import LiveServer

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
USER: list[Any] = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]


@pytest.fixture(scope="module")
def oai(real_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def claude(real_server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=real_server.url, api_key="x", max_retries=0) as c:
        yield c


def test_openai_round_trip(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(
        model="m",
        messages=USER,
        tools=[WEATHER],
        max_tokens=48,
        temperature=0,  # type: ignore[list-item]
    )
    message = r.choices[0].message
    calls = message.tool_calls or []
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert (r.choices[0].finish_reason == "tool_calls") == bool(
        calls and r.choices[0].finish_reason != "length"
    )
    with oai.chat.completions.stream(
        model="m",
        messages=USER,
        tools=[WEATHER],
        max_tokens=48,
        temperature=0,  # type: ignore[list-item]
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == message.content
    history: list[Any] = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21, "sky": "clear"}'},
    ]  # fmt: skip
    after = oai.chat.completions.create(
        model="m",
        messages=history,
        tools=[WEATHER],
        max_tokens=32,  # type: ignore[list-item]
    )
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_anthropic_round_trip(claude: anthropic.Anthropic) -> None:
    tool: Any = {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    with claude.messages.stream(model="m", max_tokens=48, messages=USER, tools=[tool]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    history: list[Any] = [
        *USER,
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C, clear"}]},
    ]  # fmt: skip
    m = claude.messages.create(model="m", max_tokens=32, messages=history, tools=[tool])
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    count = claude.messages.count_tokens(model="m", messages=history, tools=[tool])
    assert count.input_tokens > 0


def test_auto_calls_always_parse(oai: openai.OpenAI) -> None:
    city = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    strict: Any = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": city,
            "strict": True,
        },
    }
    loose: Any = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }

    def answer(seed: int) -> Any:
        return oai.chat.completions.create(
            model="m",
            messages=USER,
            tools=[strict, loose],
            max_tokens=48,
            temperature=0.7,
            seed=seed,
        ).choices[0]

    calls: list[tuple[str, Any]] = []
    with ThreadPoolExecutor(8) as pool:  # eight at a time
        choices = list(pool.map(answer, range(24)))
    for choice in choices:
        made = choice.message.tool_calls or []
        if choice.finish_reason == "length":
            made = made[:-1]  # a call cut by max_tokens may end inside its arguments
        for c in made:
            assert c.type == "function"
            arguments = json.loads(c.function.arguments)
            assert isinstance(arguments, dict)
            assert c.function.name in ("get_weather", "search")
            if c.function.name == "get_weather":
                jsonschema.validate(arguments, city)
            calls.append((c.function.name, arguments))
    assert calls, calls  # the model does call (about one answer in four here); each parsed
