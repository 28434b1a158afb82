"""Tools beside a response format in every API, through the official SDKs over the fake engine:
the constraint each request reaches the engine with (a forced choice: the calls; auto: calls or
the format), and a plain request that never enters the tool machinery. What the grammars accept
is tested against llguidance in test_tool_grammar.py, on the real model in test_tools_real.py."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import msgspec
import openai

from deepinfer.api.anthropic.schemas import MessagesRequest
from deepinfer.api.anthropic.tools import anthropic_plan
from deepinfer.api.openai.schemas import ChatCompletionRequest
from deepinfer.api.openai.tools import openai_plan
from deepinfer.api.responses.schemas import ResponsesRequest
from deepinfer.api.responses.tools import responses_plan
from deepinfer.api.tools.plan import NO_TOOLS
from deepinfer.request import StructuredKind, StructuredSpec
from tests.api.fake_engine import REPLY, FakeEngine

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
OPENAI_TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
]
RESPONSE_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
USER: Any = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def sent(engine: FakeEngine) -> StructuredSpec:
    spec = engine.last_params.structured if engine.last_params else None
    assert spec is not None
    return spec


def check_calls_or_format(spec: StructuredSpec, format_param: str) -> None:
    """Auto beside a format: one grammar, a call of the tool or the format's JSON."""
    assert spec.kind is StructuredKind.GRAMMAR and spec.param == format_param
    assert spec.source.startswith("start: calls | text\n") and "get_weather" in spec.source
    assert spec.parts[-1].param == format_param
    assert json.loads(spec.parts[-1].source)["required"] == ["answer"]


def check_calls_only(spec: StructuredSpec) -> None:
    assert spec.kind is StructuredKind.GRAMMAR and spec.param == "tool_choice"
    assert spec.source.startswith("start: calls\n") and "answer" not in spec.source


def test_chat(oai: openai.OpenAI, reply: FakeEngine) -> None:
    reply.reply = CALL
    r = oai.chat.completions.create(
        model="m", messages=USER, tools=OPENAI_TOOLS, response_format=RESPONSE_FORMAT
    )
    check_calls_or_format(sent(reply), "response_format.json_schema.schema")
    assert r.choices[0].finish_reason == "tool_calls"
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = oai.chat.completions.create(
            model="m", messages=USER, tools=OPENAI_TOOLS, response_format=RESPONSE_FORMAT,
            tool_choice=choice,  # type: ignore[arg-type]
        )  # fmt: skip
        check_calls_only(sent(reply))
        calls = r.choices[0].message.tool_calls or []
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    reply.reply = '{"answer": "sunny"}'
    r = oai.chat.completions.create(
        model="m", messages=USER, tools=OPENAI_TOOLS, response_format=RESPONSE_FORMAT,
        tool_choice="none",
    )  # fmt: skip
    assert sent(reply).kind is StructuredKind.JSON_SCHEMA
    assert r.choices[0].message.content == reply.reply


def test_anthropic_messages(claude: anthropic.Anthropic, reply: FakeEngine) -> None:
    reply.reply = CALL
    tools: Any = [{"name": "get_weather", "input_schema": PARAMETERS}]
    fmt = {"output_format": {"type": "json_schema", "schema": ANSWER}}
    m = claude.messages.create(
        model="m", max_tokens=200, messages=USER, tools=tools, extra_body=fmt
    )
    check_calls_or_format(sent(reply), "output_format.schema")
    assert m.stop_reason == "tool_use"
    m = claude.messages.create(
        model="m", max_tokens=200, messages=USER, tools=tools, extra_body=fmt,
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    check_calls_only(sent(reply))
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]


def test_responses(oai: openai.OpenAI, reply: FakeEngine) -> None:
    reply.reply = CALL
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}]
    text: Any = {"format": {"type": "json_schema", "name": "a", "schema": ANSWER}}
    r = oai.responses.create(model="m", input=USER, tools=tools, text=text)
    check_calls_or_format(sent(reply), "text.format.schema")
    assert [item.type for item in r.output] == ["function_call"]
    named: Any = {"type": "function", "name": "get_weather"}
    r = oai.responses.create(model="m", input=USER, tools=tools, text=text, tool_choice=named)
    check_calls_only(sent(reply))
    assert r.status == "completed" and [item.type for item in r.output] == ["function_call"]


def test_a_plain_request_gets_no_tools_and_no_constraint(
    oai: openai.OpenAI, reply: FakeEngine
) -> None:
    plain = msgspec.json.encode({"model": "m", "messages": USER})
    assert openai_plan(msgspec.json.decode(plain, type=ChatCompletionRequest)) is NO_TOOLS
    messages = msgspec.json.encode({"model": "m", "max_tokens": 5, "messages": USER})
    assert anthropic_plan(msgspec.json.decode(messages, type=MessagesRequest)) is NO_TOOLS
    response = msgspec.json.encode({"model": "m", "input": "hi"})
    assert responses_plan(msgspec.json.decode(response, type=ResponsesRequest)) is NO_TOOLS
    r = oai.chat.completions.create(model="m", messages=USER)
    assert reply.last_params is not None and reply.last_params.structured is None
    assert r.choices[0].message.content == REPLY and r.choices[0].message.tool_calls is None


def test_auto_alone_constrains_calls_strict_tools_by_their_schema(
    oai: openai.OpenAI, claude: anthropic.Anthropic, reply: FakeEngine
) -> None:
    """`auto` without a format: the grammar of calls once opened in every API, a tool's schema a
    checked part of it where the tool is strict (the Responses API's default)."""
    reply.reply = CALL
    strict: Any = [{**OPENAI_TOOLS[0], "function": {**OPENAI_TOOLS[0]["function"], "strict": True}}]
    for tools, parts in ((OPENAI_TOOLS, []), (strict, ["tools[0].function.parameters"])):
        oai.chat.completions.create(model="m", messages=USER, tools=tools)
        spec = sent(reply)
        assert spec.param == "tools" and [p.param for p in spec.parts] == parts
    flat = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}
    for tool, parts in (({**flat}, ["tools[0].parameters"]), ({**flat, "strict": False}, [])):
        oai.responses.create(model="m", input=USER, tools=[tool])  # type: ignore[list-item]
        spec = sent(reply)
        assert spec.param == "tools" and [p.param for p in spec.parts] == parts
    custom: Any = {"name": "get_weather", "input_schema": PARAMETERS}
    for tool, parts in ((custom, []), ({**custom, "strict": True}, ["tools.0.input_schema"])):
        claude.messages.create(model="m", max_tokens=8, messages=USER, tools=[tool])
        spec = sent(reply)
        assert spec.param == "tools" and [p.param for p in spec.parts] == parts
        assert spec.kind is StructuredKind.GRAMMAR and "lead[lazy]" in spec.source
