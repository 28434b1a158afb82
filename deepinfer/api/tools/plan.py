"""What a request's tools ask of one answer: the definitions to render, whether to parse calls.

Shared by the OpenAI and Anthropic routes: a `ToolPlan` per request, a `ToolStream` per choice
that turns the answer's text into content and call pieces with the wire's call ids.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from deepinfer.api.http.errors import ApiError, ErrorKind
from deepinfer.request import FinishReason
from deepinfer.text.messages import ToolSpec, arguments_json
from deepinfer.text.tool_markup import CallMarkup, FamilyTools
from deepinfer.text.tool_parser import (
    ParsedAnswer,
    ParseEvent,
    ToolCallParser,
    collect_events,
)
from deepinfer.text.tools import HERMES_MARKUP

EMPTY_PARAMETERS = '{"type": "object", "properties": {}, "additionalProperties": false}'
"""The schema of a function declared without parameters: its arguments are `{}`."""


def invalid(param: str, message: str) -> ApiError:
    return ApiError(ErrorKind.INVALID_REQUEST, f"{param}: {message}", param=param)


@dataclass(frozen=True)
class ToolSchema:
    """A tool's name and its arguments' JSON schema, for a forced call's grammar."""

    name: str
    parameters: str
    """The JSON schema (JSON text) the arguments validate against."""
    param: str
    """The request field holding the schema, named when the schema cannot be compiled."""
    strict: bool = False
    """`strict: true`: a call the model chooses to write (`auto`) follows the schema too; else
    its arguments are only a JSON object."""


@dataclass(frozen=True)
class ToolPlan:
    """The tools rendered into the prompt, whether (and how many) calls are parsed back, and
    which tools a forced choice must call."""

    specs: tuple[ToolSpec, ...] = ()
    max_calls: int | None = None
    """At most this many calls are reported (1 without parallel calls); None: any number."""
    forced: tuple[ToolSchema, ...] = ()
    """Non-empty: the answer is only calls of these tools, by constrained decoding (`required`,
    `any`, or one named tool); empty: the model chooses freely (`auto`)."""
    schemas: tuple[ToolSchema, ...] = ()
    """Every declared tool's schema (for `auto` beside a response format: calls or the format)."""
    markup: CallMarkup = HERMES_MARKUP
    """How the model's family writes calls (what the answer is parsed with)."""

    @property
    def parses_calls(self) -> bool:
        return bool(self.specs)

    def written_in(self, fmt: FamilyTools | None) -> ToolPlan:
        """The plan for a model whose tool format is `fmt` (None: Hermes, the default)."""
        return self if fmt is None else dataclasses.replace(self, markup=fmt.markup)


NO_TOOLS = ToolPlan()


@dataclass(frozen=True)
class ToolChoice:
    """A request's tool choice, wire-neutral: `mode` is none, auto, required or named."""

    mode: str = "auto"
    name: str | None = None
    """The tool a `named` choice calls."""
    name_param: str = "tool_choice"
    """The field naming it (400 when no tool has that name)."""


def tool_plan(
    specs: tuple[ToolSpec, ...],
    schemas: tuple[ToolSchema, ...],
    choice: ToolChoice,
    max_calls: int | None,
) -> ToolPlan:
    """The plan of declared tools (specs and schemas in the same order) under `choice`."""
    if choice.mode in ("required", "named") and not specs:
        raise invalid(choice.name_param, f"{choice.mode!r} needs at least one tool in tools")
    if choice.mode == "none" or not specs:
        return NO_TOOLS
    forced: tuple[ToolSchema, ...] = ()
    if choice.mode == "required":
        forced = schemas
    elif choice.mode == "named":
        forced = tuple(s for s in schemas if s.name == choice.name)
        if not forced:
            names = ", ".join(repr(s.name) for s in schemas)
            raise invalid(choice.name_param, f"no tool is named {choice.name!r} (tools: {names})")
        return ToolPlan(specs, 1, forced[:1], schemas)  # a named tool is called exactly once
    return ToolPlan(specs, max_calls, forced, schemas)


def call_arguments(arguments: Any, param: str) -> str:
    """Canonical JSON text of call arguments given as a JSON string (OpenAI) or object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise invalid(param, f"is not valid JSON ({exc.msg})") from None
    if not isinstance(arguments, dict):
        raise invalid(param, "must be a JSON object")
    return arguments_json(arguments)


def new_call_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass
class ToolStream:
    """One choice's answer, split into content and calls as it streams; ids are `prefix...`."""

    plan: ToolPlan
    id_prefix: str
    ids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._parser = ToolCallParser(self.plan.max_calls, self.plan.markup)

    def feed(self, text: str, finished: bool) -> list[ParseEvent]:
        events = self._parser.feed(text)
        if finished:
            events += self._parser.finish()
        for e in events:
            if getattr(e, "name", None) is not None:
                self.ids.append(new_call_id(self.id_prefix))
        return events

    @property
    def num_calls(self) -> int:
        return len(self.ids)

    @property
    def truncated(self) -> bool:
        """The answer ended inside its last call's arguments (known once it finished)."""
        return self._parser.truncated

    def answer(self, text: str) -> ParsedAnswer:
        """A whole answer at once (non-streaming), ids assigned as streaming would."""
        return collect_events(self.feed(text, finished=True))


def called(reason: FinishReason | None, num_calls: int) -> bool:
    """Whether an answer ends because it called tools (a natural stop after at least one)."""
    return num_calls > 0 and reason is FinishReason.STOP
