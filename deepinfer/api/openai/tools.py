"""OpenAI function tools: request fields -> `ToolPlan` and history calls; answers -> wire calls.

`strict: true` makes a call the model writes under `auto` follow the tool's schema (else its
arguments are any JSON object, see `api/tools/grammar.py`); a forced choice always constrains
the arguments to their schema.
"""

from __future__ import annotations

import json

import msgspec

from deepinfer.api.openai.schemas import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessageIn,
    ChunkDelta,
    FunctionCallOut,
    FunctionChunk,
    FunctionTool,
    NamedToolChoice,
    ToolCallChunk,
    ToolCallOut,
)
from deepinfer.api.tools.plan import (
    EMPTY_PARAMETERS,
    NO_TOOLS,
    ToolChoice,
    ToolPlan,
    ToolSchema,
    ToolStream,
    call_arguments,
    invalid,
    tool_plan,
)
from deepinfer.text.messages import ToolCall, ToolSpec
from deepinfer.text.tool_parser import CallDelta, ContentDelta, ParseEvent

CALL_ID_PREFIX = "call_"


def openai_plan(req: ChatCompletionRequest) -> ToolPlan:
    """`tools`, `tool_choice` (none, auto, required, named) and `parallel_tool_calls`; 400
    naming the field. `required` and a named function are forced by constrained decoding. A
    request without tools and tool choice gets `NO_TOOLS` at once."""
    if not req.tools and req.tool_choice is None:
        return NO_TOOLS
    declared = [_spec(raw, i) for i, raw in enumerate(req.tools or ())]
    specs = tuple(spec for spec, _ in declared)
    schemas = tuple(schema for _, schema in declared)
    max_calls = None if req.parallel_tool_calls in (None, True) else 1
    return tool_plan(specs, schemas, _choice(req.tool_choice), max_calls)


def tool_specs(tools: list[msgspec.Raw] | None) -> tuple[ToolSpec, ...]:
    """Function tools as the recipe renders them (`/tokenize`); 400 naming a bad one."""
    return tuple(_spec(raw, i)[0] for i, raw in enumerate(tools or ()))


def _choice(choice: str | NamedToolChoice | None) -> ToolChoice:
    if choice is None or isinstance(choice, str):
        mode = choice or "auto"
        if mode not in ("none", "auto", "required"):
            raise invalid(
                "tool_choice", f"unknown value {mode!r}; use 'none', 'auto' or 'required'"
            )
        return ToolChoice(mode)
    if choice.type != "function":
        raise invalid("tool_choice.type", f"unsupported type {choice.type!r}; use 'function'")
    return ToolChoice("named", choice.function.name, "tool_choice.function.name")


def _spec(raw: msgspec.Raw, i: int) -> tuple[ToolSpec, ToolSchema]:
    try:
        tool = msgspec.json.decode(raw, type=FunctionTool)
        definition = msgspec.json.decode(raw)
    except msgspec.ValidationError as exc:
        raise invalid(f"tools[{i}]", str(exc)) from None
    if tool.type != "function" or tool.function is None:
        raise invalid(f"tools[{i}].type", f"unsupported tool type {tool.type!r}; use 'function'")
    function = tool.function
    parameters = EMPTY_PARAMETERS
    if function.parameters is not None:
        parameters = json.dumps(function.parameters, ensure_ascii=False)
    param = f"tools[{i}].function.parameters"
    schema = ToolSchema(function.name, parameters, param, strict=bool(function.strict))
    return ToolSpec.from_definition(function.name, definition), schema


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
