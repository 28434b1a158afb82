"""Responses API tools and text formats over the fake engine, through the official SDK: function
call output items (streamed and not), call items and their outputs as input, forced choice and
`text.format` as constraints, `responses.parse` with a pydantic model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pydantic
import pytest
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage

from deepinfer.request import StructuredKind
from deepinfer.text.messages import ChatMessage, ToolCall, ToolSpec
from tests.api.fake_engine import REPLY, FakeEngine
from tests.api.live_server import LiveServer

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def call(name: str, args: dict[str, Any]) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


TWO_CALLS = (
    "Let me check."
    + call("get_weather", {"city": "Paris"})
    + "\n"
    + call("get_weather", {"city": "Oslo"})
)


@pytest.fixture(scope="module")
def client(fake_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=fake_server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture
def reply(fake_engine: FakeEngine) -> Iterator[FakeEngine]:
    yield fake_engine
    fake_engine.reply = REPLY


@pytest.mark.slow
def test_function_call_items(client: openai.OpenAI, reply: FakeEngine) -> None:
    reply.reply = TWO_CALLS
    r = client.responses.create(model="m", input="Weather?", tools=[WEATHER])
    assert [item.type for item in r.output] == ["message", "function_call", "function_call"]
    assert r.output_text == "Let me check."
    calls = [item for item in r.output if isinstance(item, ResponseFunctionToolCall)]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert all(c.id and c.id.startswith("fc_") and c.call_id.startswith("call_") for c in calls)
    assert all(c.status == "completed" and c.name == "get_weather" for c in calls)
    assert r.tools[0].type == "function" and r.tools[0].name == "get_weather"
    assert r.tool_choice == "auto" and r.parallel_tool_calls
    one = client.responses.create(
        model="m", input="Weather?", tools=[WEATHER], parallel_tool_calls=False
    )
    assert [item.type for item in one.output] == ["message", "function_call"]
    assert not one.parallel_tool_calls


def test_streamed_calls_accumulate(client: openai.OpenAI, reply: FakeEngine) -> None:
    reply.reply = TWO_CALLS
    with client.responses.stream(model="m", input="Weather?", tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types.count("response.output_item.added") == 3
    assert types.count("response.output_item.done") == 3
    assert types.count("response.function_call_arguments.done") == 2
    assert types[-1] == "response.completed"
    first = types.index("response.function_call_arguments.delta")
    assert types[first - 1] == "response.output_item.added"
    assert types[first - 4 : first - 1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [{"city": "Paris"}, {"city": "Oslo"}]
    calls = [item for item in final.output if isinstance(item, ResponseFunctionToolCall)]
    assert [c.arguments for c in calls] == [e.arguments for e in done]
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.id for i in added] == [i.id for i in final.output]


def test_calls_and_outputs_as_input(client: openai.OpenAI, reply: FakeEngine) -> None:
    reply.reply = call("get_weather", {"city": "Paris"})
    first = client.responses.create(model="m", input="Weather?", tools=[WEATHER])
    (fc,) = first.output
    assert isinstance(fc, ResponseFunctionToolCall)
    reply.reply = REPLY
    result: Any = {"type": "function_call_output", "call_id": fc.call_id, "output": "21 C"}
    second = client.responses.create(
        model="m", input=[result], tools=[WEATHER], previous_response_id=first.id
    )
    assert second.output_text == REPLY
    items: Any = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": fc.call_id, "name": fc.name,
         "arguments": fc.arguments, "id": fc.id, "status": "completed"},
        result,
    ]  # fmt: skip
    third = client.responses.create(model="m", input=items, tools=[WEATHER])
    assert second.usage is not None and third.usage is not None
    assert second.usage.input_tokens == third.usage.input_tokens  # the same conversation
    history = [
        ChatMessage("user", "Weather?"),
        ChatMessage(
            "assistant", "", tool_calls=(ToolCall("get_weather", fc.arguments, fc.call_id),)
        ),
        ChatMessage("tool", "21 C", tool_call_id=fc.call_id),
    ]
    spec = ToolSpec.from_definition(
        "get_weather", {"type": "function", "function": {k: WEATHER[k] for k in
                                                         ("name", "description", "parameters")}}
    )  # fmt: skip
    assert third.usage.input_tokens == len(reply.recipe.encode(history, tools=[spec]))


def test_forced_choice_and_format_are_constraints(client: openai.OpenAI, reply: FakeEngine) -> None:
    reply.reply = call("get_weather", {"city": "Paris"})
    named: Any = {"type": "function", "name": "get_weather"}
    r = client.responses.create(model="m", input="Weather?", tools=[WEATHER], tool_choice=named)
    spec = reply.last_params.structured if reply.last_params else None
    assert spec is not None and spec.kind is StructuredKind.GRAMMAR and "get_weather" in spec.source
    assert r.tool_choice.type == "function"  # type: ignore[union-attr]
    fmt: Any = {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}
    r = client.responses.create(model="m", input="x", text={"format": fmt})
    spec = reply.last_params.structured if reply.last_params else None
    assert spec is not None and spec.kind is StructuredKind.JSON_SCHEMA
    assert spec.param == "text.format.schema"
    assert r.text.format is not None and r.text.format.type == "json_schema"
    client.responses.create(model="m", input="x", text={"format": {"type": "json_object"}})
    spec = reply.last_params.structured if reply.last_params else None
    assert spec is not None and spec.kind is StructuredKind.JSON_OBJECT


class Weather(pydantic.BaseModel):
    city: str
    celsius: int


def test_parse_with_a_pydantic_model(client: openai.OpenAI, reply: FakeEngine) -> None:
    reply.reply = '{"city": "Paris", "celsius": 21}'
    r = client.responses.parse(model="m", input="Weather?", text_format=Weather)
    assert r.output_parsed == Weather(city="Paris", celsius=21)
    spec = reply.last_params.structured if reply.last_params else None
    assert spec is not None and json.loads(spec.source)["required"] == ["city", "celsius"]
    assert isinstance(r.output[0], ResponseOutputMessage)
