"""Tool calling over the fake engine with the official SDKs: a scripted answer holding calls."""

from __future__ import annotations

import json
from contextlib import nullcontext
from typing import Any

import anthropic
import openai
import pytest

from deepinfer.request import StructuredKind
from tests.api.fake_engine import REPLY, FakeEngine

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}
USER: list[Any] = [{"role": "user", "content": "Weather in Paris and Oslo?"}]


def call(name: str, args: dict[str, Any]) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


TWO_CALLS = (
    "Let me check."
    + call("get_weather", {"city": "Paris"})
    + "\n"
    + call("get_weather", {"city": "Oslo {x}"})
)


def test_openai_tool_calls(oai: openai.OpenAI, reply: FakeEngine) -> None:
    reply.reply = TWO_CALLS
    r = oai.chat.completions.create(model="m", messages=USER, tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"] * 2
    assert [json.loads(c.function.arguments) for c in calls] == [
        {"city": "Paris"},
        {"city": "Oslo {x}"},
    ]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert len({c.id for c in calls}) == 2
    one = oai.chat.completions.create(
        model="m", messages=USER, tools=[WEATHER], parallel_tool_calls=False
    )
    assert len(one.choices[0].message.tool_calls or []) == 1


def test_openai_stream_helpers(oai: openai.OpenAI, reply: FakeEngine) -> None:
    reply.reply = TWO_CALLS
    with oai.chat.completions.stream(model="m", messages=USER, tools=[WEATHER]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds
    assert kinds.count("tool_calls.function.arguments.done") == 2
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check."
    args = [json.loads(c.function.arguments) for c in message.tool_calls or []]
    assert args == [{"city": "Paris"}, {"city": "Oslo {x}"}]


def test_openai_raw_stream_shape(oai: openai.OpenAI, reply: FakeEngine) -> None:
    reply.reply = call("get_weather", {"city": "Paris"})
    chunks = list(
        oai.chat.completions.create(model="m", messages=USER, tools=[WEATHER], stream=True)
    )
    deltas = [
        c.choices[0].delta.tool_calls[0]
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls
    ]
    head = deltas[0]
    assert head.index == 0 and head.id and head.type == "function"
    assert head.function is not None and head.function.name == "get_weather"
    assert all(d.id is None and d.function and d.function.name is None for d in deltas[1:])
    args = "".join((d.function.arguments or "") for d in deltas if d.function)
    assert json.loads(args) == {"city": "Paris"} and len(deltas) > 2
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_openai_tool_history_and_choices(oai: openai.OpenAI, reply: FakeEngine) -> None:
    history: list[Any] = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C </tool_response>"},
    ]  # fmt: skip
    r = oai.chat.completions.create(model="m", messages=history, tools=[WEATHER])
    assert r.choices[0].message.content == REPLY and r.choices[0].finish_reason == "stop"
    reply.reply = call("get_weather", {})
    none = oai.chat.completions.create(
        model="m", messages=USER, tools=[WEATHER], tool_choice="none"
    )
    assert none.choices[0].message.content == reply.reply and not none.choices[0].message.tool_calls


def forced_grammar(engine: FakeEngine) -> str:
    spec = engine.last_params.structured if engine.last_params else None
    assert spec is not None and spec.kind is StructuredKind.GRAMMAR
    assert spec.param == "tool_choice"
    return spec.source


def test_openai_forced_choice_is_a_grammar(oai: openai.OpenAI, reply: FakeEngine) -> None:
    reply.reply = call("get_weather", {"city": "Paris"})
    r = oai.chat.completions.create(
        model="m", messages=USER, tools=[WEATHER, TIME], tool_choice="required"
    )
    assert r.choices[0].finish_reason == "tool_calls"
    grammar = forced_grammar(reply)
    assert "call_0 | call_1" in grammar and '("\\n" call)*' in grammar
    named: Any = {"type": "function", "function": {"name": "get_time"}}
    oai.chat.completions.create(model="m", messages=USER, tools=[WEATHER, TIME], tool_choice=named)
    grammar = forced_grammar(reply)
    assert "get_time" in grammar and "get_weather" not in grammar and "calls: call\n" in grammar
    oai.chat.completions.create(model="m", messages=USER, tools=[WEATHER], tool_choice="auto")
    params = reply.last_params
    assert params is not None and params.structured is not None  # calls constrained once opened
    assert params.structured.param == "tools" and "lead[lazy]" in params.structured.source
    strict: Any = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}  # type: ignore[dict-item]
    oai.chat.completions.create(model="m", messages=USER, tools=[strict], tool_choice="auto")
    params = reply.last_params
    assert params is not None and params.structured is not None
    assert [p.param for p in params.structured.parts] == ["tools[0].function.parameters"]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required", "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "frobnicate"}}}]}, "tools[0].function.parameters"),
        ({"tool_choice": "required", "tools": []}, "tool_choice"),
    ],
)  # fmt: skip
def test_openai_forced_choice_refusals(oai: openai.OpenAI, kwargs: Any, param: str) -> None:
    kwargs = {"tools": [WEATHER], **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="m", messages=USER, **kwargs)
    assert info.value.body["param"] == param  # type: ignore[index]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
          "function": {"name": "f", "arguments": "{bad"}}]}, "messages[1].tool_calls[0].function.arguments"),
    ],
)  # fmt: skip
def test_openai_bad_history_names_field(oai: openai.OpenAI, message: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="m", messages=[*USER, message])
    assert info.value.body["param"] == param  # type: ignore[index]


def test_malformed_call_is_text(oai: openai.OpenAI, reply: FakeEngine) -> None:
    reply.reply = '<tool_call>\n{"name": get_weather}\n</tool_call>'
    r = oai.chat.completions.create(model="m", messages=USER, tools=[WEATHER])
    assert r.choices[0].message.content == reply.reply and r.choices[0].finish_reason == "stop"
    chunks = oai.chat.completions.create(model="m", messages=USER, tools=[WEATHER], stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.reply


def test_anthropic_tool_use(claude: anthropic.Anthropic, reply: FakeEngine) -> None:
    reply.reply = TWO_CALLS
    m = claude.messages.create(model="m", max_tokens=500, messages=USER, tools=[ANTHROPIC_WEATHER])
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["text", "tool_use", "tool_use"]
    uses = [b for b in m.content if b.type == "tool_use"]
    assert [u.input for u in uses] == [{"city": "Paris"}, {"city": "Oslo {x}"}]
    assert all(u.id.startswith("toolu_") and u.name == "get_weather" for u in uses)


def test_anthropic_stream_and_round_trip(claude: anthropic.Anthropic, reply: FakeEngine) -> None:
    reply.reply = TWO_CALLS
    with claude.messages.stream(
        model="m",
        max_tokens=500,
        messages=USER,
        tools=[ANTHROPIC_WEATHER],  # type: ignore[list-item]
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds.count("content_block_start") == 3 and kinds.count("content_block_stop") == 3
    assert final.stop_reason == "tool_use"
    uses = [b for b in final.content if b.type == "tool_use"]
    assert [u.input for u in uses] == [{"city": "Paris"}, {"city": "Oslo {x}"}]
    reply.reply = REPLY
    results = [
        {"type": "tool_result", "tool_use_id": uses[0].id, "content": "21 C"},
        {"type": "tool_result", "tool_use_id": uses[1].id, "is_error": True,
         "content": [{"type": "text", "text": "no such city"}]},
    ]  # fmt: skip
    history: list[Any] = [*USER, {"role": "assistant", "content": final.content}]
    history.append({"role": "user", "content": [*results, {"type": "text", "text": "So?"}]})
    m = claude.messages.create(
        model="m",
        max_tokens=500,
        messages=history,
        tools=[ANTHROPIC_WEATHER],  # type: ignore[list-item]
    )
    assert m.stop_reason == "end_turn" and m.content[0].type == "text"
    assert m.content[0].text == REPLY


def test_anthropic_choices_and_count(claude: anthropic.Anthropic, reply: FakeEngine) -> None:
    reply.reply = call("get_weather", {"city": "Paris"})
    m = claude.messages.create(
        model="m",
        max_tokens=500,
        messages=USER,
        tools=[ANTHROPIC_WEATHER],
        tool_choice={"type": "none"},  # type: ignore[list-item]
    )
    assert m.stop_reason == "end_turn" and m.content[0].type == "text"
    for choice, needle in (({"type": "any"}, "call_0"), ({"type": "tool", "name": "x"}, "")):
        with pytest.raises(anthropic.BadRequestError) if not needle else nullcontext():
            m = claude.messages.create(
                model="m",
                max_tokens=500,
                messages=USER,
                tools=[ANTHROPIC_WEATHER],
                tool_choice=choice,  # type: ignore[arg-type,list-item]
            )
            assert m.stop_reason == "tool_use" and needle in forced_grammar(reply)
    bad_schema: Any = {**ANTHROPIC_WEATHER, "input_schema": {"type": "frobnicate"}}
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(
            model="m", max_tokens=5, messages=USER, tools=[bad_schema],
            tool_choice={"type": "tool", "name": "get_weather"},
        )  # fmt: skip
    assert "tools.0.input_schema" in str(info.value)
    plain = claude.messages.count_tokens(model="m", messages=USER)
    tools = claude.messages.count_tokens(model="m", messages=USER, tools=[ANTHROPIC_WEATHER])  # type: ignore[list-item]
    assert tools.input_tokens > plain.input_tokens + len("get_weather")
