"""Forced tool choice and structured formats on the real model (SmolLM2-135M), through the
official SDKs: every answer is calls that parse and whose arguments validate against their
schema, ending the turn (`tool_calls` / `tool_use`), streamed and not; the Responses API too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import ResponseFunctionToolCall

from tests.api.live_server import LiveServer

pytestmark = pytest.mark.slow

CITY: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ZONE: dict[str, Any] = {
    "type": "object",
    "properties": {"offset_hours": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["offset_hours"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": CITY, "get_time": ZONE}
OPENAI_TOOLS: Any = [
    {"type": "function", "function": {"name": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
ANTHROPIC_TOOLS: Any = [{"name": name, "input_schema": s} for name, s in SCHEMAS.items()]
RESPONSES_TOOLS: Any = [
    {"type": "function", "name": name, "parameters": s, "strict": True}
    for name, s in SCHEMAS.items()
]
USER: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 256


@pytest.fixture(scope="module")
def oai(real_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def claude(real_server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=real_server.url, api_key="x", max_retries=0) as c:
        yield c


def check_call(name: str, arguments: str | object, only: str | None = None) -> None:
    """The call names a declared tool (`only`, when named) with arguments valid for it, spelled
    as the next turn renders them (`json.dumps`: the cached prefix reaches through the call)."""
    assert name in SCHEMAS and name == (only or name)
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(value, SCHEMAS[name])
    if isinstance(arguments, str):
        assert arguments == json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize(
    ("choice", "parallel", "only"),
    [
        ("required", None, None),
        ("required", False, None),
        ({"type": "function", "function": {"name": "get_time"}}, None, "get_time"),
    ],
)
def test_openai_forced(oai: openai.OpenAI, choice: Any, parallel: bool | None, only: str) -> None:
    extra: Any = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = oai.chat.completions.create(
        model="m", messages=USER, tools=OPENAI_TOOLS, tool_choice=choice,
        max_tokens=MAX_TOKENS, temperature=0, **extra,
    )  # fmt: skip
    choice0 = r.choices[0]
    calls = choice0.message.tool_calls or []
    assert calls
    if parallel is None and only is None:
        # Any number of calls: this model repeats its call until max_tokens cuts the last one
        # (a truncated call, or dropped if cut before its name; never content).
        assert choice0.finish_reason in ("tool_calls", "length") and len(calls) > 1
        calls = calls if choice0.finish_reason == "tool_calls" else calls[:-1]
    else:
        assert choice0.finish_reason == "tool_calls" and len(calls) == 1
    assert not choice0.message.content
    for c in calls:
        check_call(c.function.name, c.function.arguments, only)
    if choice0.finish_reason == "length":
        return  # the SDK's stream helper raises on length
    with oai.chat.completions.stream(
        model="m", messages=USER, tools=OPENAI_TOOLS, tool_choice=choice,
        max_tokens=MAX_TOKENS, temperature=0, **extra,
    ) as stream:  # fmt: skip
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls or []
    assert final.choices[0].finish_reason == choice0.finish_reason
    assert [(c.function.name, c.function.arguments) for c in streamed][: len(calls)] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


@pytest.mark.parametrize(
    ("choice", "only"),
    [
        ({"type": "any", "disable_parallel_tool_use": True}, None),
        ({"type": "tool", "name": "get_time"}, "get_time"),
    ],
)
def test_anthropic_forced(claude: anthropic.Anthropic, choice: Any, only: str | None) -> None:
    m = claude.messages.create(
        model="m", max_tokens=MAX_TOKENS, messages=USER, tools=ANTHROPIC_TOOLS,
        tool_choice=choice, extra_body={"temperature": 0},
    )  # fmt: skip
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses and len(uses) == len(m.content)
    for u in uses:
        check_call(u.name, u.input, only)
    with claude.messages.stream(
        model="m", max_tokens=MAX_TOKENS, messages=USER, tools=ANTHROPIC_TOOLS,
        tool_choice=choice, extra_body={"temperature": 0},
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (u.name, u.input) for u in uses
    ]


def test_responses_forced_calls(oai: openai.OpenAI) -> None:
    kwargs: Any = {
        "model": "m", "input": "What is the weather in Paris?", "tools": RESPONSES_TOOLS,
        "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0,
        "max_output_tokens": MAX_TOKENS,
    }  # fmt: skip
    r = oai.responses.create(**kwargs)
    assert r.status == "completed" and [item.type for item in r.output] == ["function_call"]
    (fc,) = r.output
    assert isinstance(fc, ResponseFunctionToolCall)
    check_call(fc.name, fc.arguments)
    with oai.responses.stream(**kwargs) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and final.status == "completed"
    (streamed,) = final.output
    assert isinstance(streamed, ResponseFunctionToolCall)
    assert (streamed.name, streamed.arguments) == (fc.name, fc.arguments)
    result: Any = {"type": "function_call_output", "call_id": fc.call_id, "output": "21 C"}
    after = oai.responses.create(
        model="m", input=[result], previous_response_id=r.id, tools=RESPONSES_TOOLS,
        temperature=0, max_output_tokens=24,
    )  # fmt: skip
    assert after.status in ("completed", "incomplete")


class Weather(pydantic.BaseModel):
    city: str
    celsius: int


def test_responses_parse_and_refused_schema(oai: openai.OpenAI) -> None:
    r = oai.responses.parse(
        model="m", input="Weather in Paris as JSON.", text_format=Weather, temperature=0,
        max_output_tokens=MAX_TOKENS,
    )  # fmt: skip
    assert r.status == "completed" and isinstance(r.output_parsed, Weather)
    fmt: Any = {"type": "json_schema", "name": "w", "schema": {"type": "frobnicate"}}
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="m", input="x", text={"format": fmt})
    assert info.value.body["param"] == "text.format.schema"  # type: ignore[index]


class Answer(pydantic.BaseModel):
    answer: str = pydantic.Field(max_length=12)


class GetWeather(pydantic.BaseModel):
    """Current weather in a city."""

    city: str = pydantic.Field(max_length=12)


def first_token_bias(real_server: LiveServer, text: str) -> dict[str, int]:
    """A logit bias that makes `text`'s first token the likeliest at every step."""
    body = {"model": "m", "prompt": text, "add_special_tokens": False}
    ids = httpx.post(f"{real_server.url}/tokenize", json=body).json()["tokens"]
    return {str(ids[0]): 100}


@pytest.mark.parametrize("lead", ["<", "{"], ids=["call", "text"])
def test_auto_with_a_format_is_a_call_or_the_format(
    oai: openai.OpenAI, real_server: LiveServer, lead: str
) -> None:
    """Under `auto`, tools and a response format are one grammar: pushed towards `<` the model
    calls the tool (arguments valid), towards `{` it answers in the format; `parse` reads both."""
    r = oai.chat.completions.parse(
        model="m", messages=USER, tools=[openai.pydantic_function_tool(GetWeather)],
        response_format=Answer, parallel_tool_calls=False, temperature=0,
        max_tokens=MAX_TOKENS, logit_bias=first_token_bias(real_server, lead),
    )  # fmt: skip
    choice = r.choices[0]
    if lead == "<":
        (tool_call,) = choice.message.tool_calls or []
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert isinstance(tool_call.function.parsed_arguments, GetWeather)
    else:
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert isinstance(choice.message.parsed, Answer)
