"""The conversation as the chat encoder takes it: turns, the tool calls in them, tool definitions.

Plain frozen records (no JSON parsing here): the API validates and normalises what clients send,
the recipe (`recipe.py`, `tools.py`) renders it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant turn made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    """A JSON object as `json.dumps(..., ensure_ascii=False)` writes it (see `arguments_json`)."""
    id: str | None = None


@dataclass(frozen=True)
class ToolSpec:
    """A tool the model may call: its name and its definition, rendered as JSON text."""

    name: str
    definition: str
    """The definition object as `json.dumps(..., ensure_ascii=False)` writes it (the `tojson`
    of transformers' chat templates), key order as the client sent it."""

    @staticmethod
    def from_definition(name: str, definition: Mapping[str, Any]) -> ToolSpec:
        return ToolSpec(name, json.dumps(definition, ensure_ascii=False))


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation, as the API hands it over (text only).

    An assistant turn may carry `tool_calls`; a `tool` turn answering one carries its
    `tool_call_id`. Either one makes the recipe render the conversation in its tool format."""

    role: str
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


def arguments_json(arguments: Any) -> str:
    """The canonical JSON text of call arguments (an object), as a chat template's `tojson`."""
    return json.dumps(arguments, ensure_ascii=False)
