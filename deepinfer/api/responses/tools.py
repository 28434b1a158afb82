"""Responses API tools and text formats: function tools, tool choice, `text.format`.

Function tools are flat (`{"type": "function", "name", "description", "parameters", "strict"}`)
and rendered through the recipe's tool format as chat tools are (`{"type": "function",
"function": {...}}`). `tool_choice` is none, auto, required or `{"type": "function", "name"}`;
a forced choice is constrained decoding (`api/tools/grammar.py`). `text.format` json_schema and
json_object constrain a text answer (with tools under `auto`: calls or that text).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from deepinfer.api.responses.schemas import ResponsesRequest
from deepinfer.api.tools.plan import (
    EMPTY_PARAMETERS,
    NO_TOOLS,
    ToolChoice,
    ToolPlan,
    ToolSchema,
    invalid,
    tool_plan,
)
from deepinfer.request import StructuredKind, StructuredSpec
from deepinfer.text.messages import ToolSpec

CALL_ID_PREFIX = "call_"
ITEM_ID_PREFIX = "fc_"


class ResponsesTool(msgspec.Struct):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedChoice(msgspec.Struct):
    type: str
    name: str | None = None


def responses_plan(req: ResponsesRequest) -> ToolPlan:
    """`tools`, `tool_choice` and `parallel_tool_calls`; 400 naming the field. A request without
    tools and tool choice gets `NO_TOOLS` at once."""
    if not req.tools and _absent(req.tool_choice):
        return NO_TOOLS
    declared = [_spec(raw, i) for i, raw in enumerate(req.tools or ())]
    specs = tuple(spec for spec, _ in declared)
    schemas = tuple(schema for _, schema in declared)
    max_calls = None if req.parallel_tool_calls in (None, True) else 1
    return tool_plan(specs, schemas, _choice(req.tool_choice), max_calls)


def _decode(raw: msgspec.Raw, kind: Any, param: str) -> Any:
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise invalid(param, str(exc)) from None


def _spec(raw: msgspec.Raw, i: int) -> tuple[ToolSpec, ToolSchema]:
    tool: ResponsesTool = _decode(raw, ResponsesTool, f"tools[{i}]")
    if tool.type != "function":
        raise invalid(f"tools[{i}].type", f"unsupported tool type {tool.type!r}; use 'function'")
    if not tool.name:
        raise invalid(f"tools[{i}].name", "a function tool needs a name")
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = tool.parameters
    parameters = EMPTY_PARAMETERS
    if tool.parameters is not None:
        parameters = json.dumps(tool.parameters, ensure_ascii=False)
    strict = tool.strict is not False  # the Responses API's default is strict
    schema = ToolSchema(tool.name, parameters, f"tools[{i}].parameters", strict=strict)
    spec = ToolSpec.from_definition(tool.name, {"type": "function", "function": function})
    return spec, schema


def _absent(raw: msgspec.Raw) -> bool:
    return not len(raw) or bytes(raw).strip() == b"null"


def _choice(raw: msgspec.Raw) -> ToolChoice:
    if _absent(raw):
        return ToolChoice()
    choice = _decode(raw, str | NamedChoice, "tool_choice")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid(
                "tool_choice", f"unknown value {choice!r}; use 'none', 'auto' or 'required'"
            )
        return ToolChoice(choice)
    if choice.type != "function":
        raise invalid("tool_choice.type", f"unsupported type {choice.type!r}; use 'function'")
    if choice.name is None:
        raise invalid("tool_choice.name", "a function choice needs the function's name")
    return ToolChoice("named", choice.name, "tool_choice.name")


def text_format_spec(req: ResponsesRequest) -> StructuredSpec | None:
    """`text.format`: json_schema and json_object constrain the answer; text does not."""
    fmt = None if req.text is None else req.text.format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredSpec(StructuredKind.JSON_OBJECT, "", "text.format")
    if fmt.type != "json_schema":
        raise invalid(
            "text.format.type",
            f"unsupported {fmt.type!r}; use 'text', 'json_schema' or 'json_object'",
        )
    if not fmt.name:
        raise invalid("text.format.name", "a json_schema format needs a name")
    if not len(fmt.schema_):
        raise invalid("text.format.schema", "is required for type 'json_schema'")
    schema = _decode(fmt.schema_, dict[str, Any], "text.format.schema")
    source = json.dumps(schema, ensure_ascii=False)
    return StructuredSpec(StructuredKind.JSON_SCHEMA, source, "text.format.schema")
