"""OpenAI function tools: request fields -> `ToolPlan` and history calls; answers -> wire calls."""

from __future__ import annotations

import msgspec

from deepinfer.api.openai_schemas import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessageIn,
    ChunkDelta,
    FunctionCallOut,
    FunctionChunk,
    FunctionTool,
    ToolCallChunk,
    ToolCallOut,
)
from deepinfer.api.tool_plan import (
    NO_CONSTRAINED_CHOICE,
    NO_TOOLS,
    ToolPlan,
    ToolStream,
    call_arguments,
    invalid,
)
from deepinfer.text.messages import ToolCall, ToolSpec
from deepinfer.text.tool_parser import CallDelta, ContentDelta, ParseEvent

CALL_ID_PREFIX = "call_"


def openai_plan(req: ChatCompletionRequest) -> ToolPlan:
    """`tools`, `tool_choice` (none, auto) and `parallel_tool_calls`; 400 naming the field."""
    choice = req.tool_choice
    if choice is not None and choice not in ("none", "auto"):
        if choice == "required" or not isinstance(choice, str):
            raise invalid("tool_choice", NO_CONSTRAINED_CHOICE)
        raise invalid("tool_choice", f"unknown value {choice!r}; use 'none' or 'auto'")
    specs = tuple(_spec(raw, i) for i, raw in enumerate(req.tools or ()))
    if choice == "none" or not specs:
        return NO_TOOLS
    return ToolPlan(specs, None if req.parallel_tool_calls in (None, True) else 1)


def _spec(raw: msgspec.Raw, i: int) -> ToolSpec:
    try:
        tool = msgspec.json.decode(raw, type=FunctionTool)
        definition = msgspec.json.decode(raw)
    except msgspec.ValidationError as exc:
        raise invalid(f"tools[{i}]", str(exc)) from None
    if tool.type != "function" or tool.function is None:
        raise invalid(f"tools[{i}].type", f"unsupported tool type {tool.type!r}; use 'function'")
    return ToolSpec.from_definition(tool.function.name, definition)


def history_calls(m: ChatMessageIn, i: int) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls`, arguments checked as JSON objects."""
    calls: list[ToolCall] = []
    for j, c in enumerate(m.tool_calls or ()):
        param = f"messages[{i}].tool_calls[{j}]"
        if c.type != "function":
            raise invalid(f"{param}.type", f"unsupported type {c.type!r}; use 'function'")
        arguments = call_arguments(c.function.arguments, f"{param}.function.arguments")
        calls.append(ToolCall(c.function.name, arguments, c.id))
    return tuple(calls)


def answer_message(text: str, stream: ToolStream | None) -> AssistantMessage:
    """The assistant message of a whole answer: content and the calls parsed from it."""
    if stream is None:
        return AssistantMessage(content=text)
    answer = stream.answer(text)
    if not answer.calls:
        return AssistantMessage(content=answer.content)
    calls = [
        ToolCallOut(id_, FunctionCallOut(c.name, c.arguments))
        for id_, c in zip(stream.ids, answer.calls, strict=True)
    ]
    return AssistantMessage(content=answer.content or None, tool_calls=calls)


def event_deltas(events: list[ParseEvent], stream: ToolStream) -> list[ChunkDelta]:
    """Chunk deltas for parse events, in order: content, a call's head, argument fragments."""
    deltas: list[ChunkDelta] = []
    for e in events:
        if isinstance(e, ContentDelta):
            deltas.append(ChunkDelta(content=e.text))
        elif isinstance(e, CallDelta):
            deltas.append(ChunkDelta(tool_calls=[_call_chunk(e, stream)]))
    return deltas


def _call_chunk(e: CallDelta, stream: ToolStream) -> ToolCallChunk:
    if e.name is None:
        return ToolCallChunk(e.index, FunctionChunk(arguments=e.arguments))
    function = FunctionChunk(name=e.name, arguments=e.arguments)
    return ToolCallChunk(e.index, function, id=stream.ids[e.index], type="function")
