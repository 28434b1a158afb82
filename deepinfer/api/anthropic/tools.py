"""Anthropic tools: request fields -> `ToolPlan`; tool_use / tool_result blocks -> turns;
answers -> tool_use blocks and their stream events."""

from __future__ import annotations

import json
from collections.abc import Iterator

import msgspec

from deepinfer.api.anthropic.schemas import (
    ContentBlockDelta,
    ContentBlockIn,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensRequest,
    InputJsonDelta,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolChoiceIn,
    ToolIn,
    ToolUseBlock,
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
from deepinfer.text.messages import ChatMessage, ToolCall, ToolSpec
from deepinfer.text.tool_parser import CallDelta, ContentDelta, ParseEvent

TOOL_ID_PREFIX = "toolu_"
ERROR_PREFIX = "Error: "
"""Written before the content of a tool_result with `is_error: true`."""

Event = ContentBlockStart | ContentBlockDelta | ContentBlockStop


def anthropic_plan(req: CountTokensRequest) -> ToolPlan:
    """`tools` (custom tools) and `tool_choice` (auto, none, any, tool); 400 naming the field.
    `any` and `tool` are forced by constrained decoding. A request without tools and tool choice
    gets `NO_TOOLS` at once."""
    if not req.tools and req.tool_choice is None:
        return NO_TOOLS
    declared = [_spec(raw, i) for i, raw in enumerate(req.tools or ())]
    specs = tuple(spec for spec, _ in declared)
    schemas = tuple(schema for _, schema in declared)
    choice = req.tool_choice
    one = choice is not None and bool(choice.disable_parallel_tool_use)
    return tool_plan(specs, schemas, _choice(choice), 1 if one else None)


_MODES = {"auto": "auto", "none": "none", "any": "required", "tool": "named"}


def _choice(choice: ToolChoiceIn | None) -> ToolChoice:
    if choice is None:
        return ToolChoice()
    mode = _MODES.get(choice.type)
    if mode is None:
        raise invalid(
            "tool_choice.type", f"unknown value {choice.type!r}; use auto, any, tool or none"
        )
    if mode == "named" and choice.name is None:
        raise invalid("tool_choice.name", "a 'tool' choice needs the tool's name")
    return ToolChoice(mode, choice.name, "tool_choice.name")


def _spec(raw: msgspec.Raw, i: int) -> tuple[ToolSpec, ToolSchema]:
    try:
        tool = msgspec.json.decode(raw, type=ToolIn)
    except msgspec.ValidationError as exc:
        raise invalid(f"tools.{i}", str(exc)) from None
    if tool.type not in (None, "custom"):
        raise invalid(f"tools.{i}.type", f"unsupported tool type {tool.type!r}; use 'custom'")
    function: dict[str, object] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema or {"type": "object", "properties": {}}
    parameters = EMPTY_PARAMETERS
    if tool.input_schema is not None:
        parameters = json.dumps(tool.input_schema, ensure_ascii=False)
    schema = ToolSchema(tool.name, parameters, f"tools.{i}.input_schema", strict=bool(tool.strict))
    spec = ToolSpec.from_definition(tool.name, {"type": "function", "function": function})
    return spec, schema


def block_turns(
    role: str, blocks: list[ContentBlockIn], param: str, declared: set[str]
) -> list[ChatMessage]:
    """One message's blocks as turns: tool results are `tool` turns, texts and tool_use blocks
    (assistant) make one turn, in the order written. `declared` holds the ids of the earlier
    turns' tool_use blocks: this message's are added, and a tool_result naming another id is a
    400 (as Anthropic answers)."""
    out: list[ChatMessage] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    for j, b in enumerate(blocks):
        at = f"{param}[{j}]"
        if b.type == "text" and b.text is not None:
            texts.append(b.text)
        elif b.type == "tool_use" and role == "assistant":
            if b.name is None or b.id is None:
                raise invalid(at, "a tool_use block needs id and name")
            calls.append(ToolCall(b.name, call_arguments(b.input or {}, f"{at}.input"), b.id))
            declared.add(b.id)
        elif b.type == "tool_result" and role == "user":
            if texts:
                out.append(ChatMessage(role, "".join(texts)))
                texts = []
            out.append(_result(b, at, declared))
        elif b.type == "text":
            raise invalid(f"{at}.text", "a text block needs text")
        else:
            raise invalid(f"{at}.type", f"unsupported content block {b.type!r} in a {role} turn")
    if texts or calls or not out:
        out.append(ChatMessage(role, "".join(texts), tool_calls=tuple(calls)))
    return out


def _result(b: ContentBlockIn, at: str, declared: set[str]) -> ChatMessage:
    if b.tool_use_id is None:
        raise invalid(f"{at}.tool_use_id", "a tool_result block needs tool_use_id")
    if b.tool_use_id not in declared:
        raise invalid(
            f"{at}.tool_use_id",
            f"unexpected tool_use_id {b.tool_use_id!r}: no earlier assistant tool_use block "
            "has this id",
        )
    content = b.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for k, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise invalid(f"{at}.content[{k}].type", "tool results hold text blocks only")
            parts.append(part.text)
        text = "".join(parts)
    text = ERROR_PREFIX + text if b.is_error else text
    return ChatMessage("tool", text, tool_call_id=b.tool_use_id)


def answer_blocks(text: str, stream: ToolStream | None) -> list[TextBlock | ToolUseBlock]:
    """A whole answer's content blocks: its text, then its calls (empty text dropped)."""
    if stream is None:
        return [TextBlock(text)]
    answer = stream.answer(text)
    blocks: list[TextBlock | ToolUseBlock] = [TextBlock(answer.content)] if answer.content else []
    blocks += [
        ToolUseBlock(id_, c.name, tool_input(c.arguments))
        for id_, c in zip(stream.ids, answer.calls, strict=True)
    ]
    return blocks or [TextBlock("")]


def tool_input(arguments: str) -> dict[str, object]:
    """A call's `input`: its arguments as an object; arguments a model left invalid give {}."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def event_name(event: Event) -> str:
    """The SSE event name of a block event (its `type` tag)."""
    tag = event.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


class BlockEvents:
    """Content block events of a streamed answer: a text block opens on text, a tool_use block
    per call; each block is stopped before the next starts."""

    def __init__(self, stream: ToolStream | None) -> None:
        self.stream = stream
        self.index = -1
        self.open: str | None = None

    def open_text(self) -> Iterator[Event]:
        """Open a text block now (answers without tools start with one at once)."""
        return self._start(TextBlock(""), "text")

    def thinking(self, text: str) -> Iterator[Event]:
        """A piece of the think block (opened at its first piece; it precedes all else)."""
        if self.open != "thinking":
            yield from self._start(ThinkingBlock(""), "thinking")
        yield ContentBlockDelta(self.index, ThinkingDelta(text))

    def events(self, text: str, finished: bool) -> Iterator[Event]:
        if self.stream is None:
            parsed: list[ParseEvent] = [ContentDelta(text)] if text else []
        else:
            parsed = self.stream.feed(text, finished)
        for e in parsed:
            yield from self._event(e)
        if finished:
            if self.open in (None, "thinking"):
                yield from self._start(TextBlock(""), "text")
            yield ContentBlockStop(self.index)

    def _event(self, e: ParseEvent) -> Iterator[Event]:
        if isinstance(e, ContentDelta):
            if self.open != "text":
                yield from self._start(TextBlock(""), "text")
            yield ContentBlockDelta(self.index, TextDelta(e.text))
        elif isinstance(e, CallDelta) and self.stream is not None:
            if e.name is not None:
                block = ToolUseBlock(self.stream.ids[e.index], e.name, {})
                yield from self._start(block, "tool_use")
            if e.arguments:
                yield ContentBlockDelta(self.index, InputJsonDelta(e.arguments))

    def _start(self, block: ThinkingBlock | TextBlock | ToolUseBlock, kind: str) -> Iterator[Event]:
        if self.open is not None:
            yield ContentBlockStop(self.index)
        self.index += 1
        self.open = kind
        yield ContentBlockStart(self.index, block)
