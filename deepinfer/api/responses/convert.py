"""Responses input items -> chat messages, and engine results -> Responses output pieces."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from deepinfer.api.http.errors import ApiError, ErrorKind
from deepinfer.api.responses.schemas import (
    IncompleteDetails,
    InputItem,
    InputPart,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseUsage,
)
from deepinfer.api.tools.plan import call_arguments
from deepinfer.engine.types import Usage
from deepinfer.request import FinishReason
from deepinfer.text.messages import ToolCall
from deepinfer.text.recipe import ChatMessage

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def invalid(param: str, message: str) -> ApiError:
    return ApiError(ErrorKind.INVALID_REQUEST, f"{param}: {message}", param=param)


def input_messages(items: str | Sequence[InputItem]) -> list[ChatMessage]:
    """The turns an `input` adds: a string is one user message; items are messages (text parts
    only), `function_call` items (joined to the assistant turn they follow),
    `function_call_output` items (tool turns) and `reasoning` items (dropped, as the reasoning
    templates drop earlier think blocks)."""
    if isinstance(items, str):
        return [ChatMessage("user", items)]
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        kind = item.type or ("message" if item.role is not None else None)
        if kind == "function_call":
            _append_call(out, _call(item, f"input[{i}]"))
        elif kind == "function_call_output":
            out.append(_call_output(item, f"input[{i}]"))
        elif kind == "message":
            out.append(_message(item, f"input[{i}]"))
        elif kind == "reasoning":
            continue  # an earlier answer's think block: history keeps no reasoning
        else:
            raise invalid(
                f"input[{i}].type",
                f"unsupported item type {kind!r}; use 'message', 'function_call' or "
                "'function_call_output'",
            )
    return out


def _call(item: InputItem, param: str) -> ToolCall:
    if item.call_id is None or item.name is None:
        raise invalid(param, "a function_call item needs call_id and name")
    if item.arguments is None:
        raise invalid(f"{param}.arguments", "a function_call item needs arguments")
    return ToolCall(item.name, call_arguments(item.arguments, f"{param}.arguments"), item.call_id)


def _append_call(out: list[ChatMessage], call: ToolCall) -> None:
    """A call joins the assistant turn just before it (its text or earlier calls)."""
    last = out[-1] if out else None
    if last is not None and last.role == "assistant":
        out[-1] = replace(last, tool_calls=(*last.tool_calls, call))
    else:
        out.append(ChatMessage("assistant", "", tool_calls=(call,)))


def _call_output(item: InputItem, param: str) -> ChatMessage:
    if item.call_id is None:
        raise invalid(f"{param}.call_id", "a function_call_output item needs call_id")
    if item.output is None:
        raise invalid(f"{param}.output", "a function_call_output item needs output")
    return ChatMessage("tool", _text(item.output, f"{param}.output"), tool_call_id=item.call_id)


def _message(item: InputItem, param: str) -> ChatMessage:
    role = _ROLES.get(item.role or "")
    if role is None:
        raise invalid(
            f"{param}.role", f"unsupported role {item.role!r}; use one of {sorted(_ROLES)}"
        )
    if item.content is None:
        raise invalid(f"{param}.content", "a message needs content")
    return ChatMessage(role, _text(item.content, f"{param}.content"))


def _text(content: str | list[InputPart], param: str) -> str:
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS:
            raise invalid(
                f"{param}[{j}].type",
                f"unsupported content part {part.type!r}; use 'input_text' or 'output_text'",
            )
        if part.text is None:
            raise invalid(f"{param}[{j}].text", "a text part needs text")
        texts.append(part.text)
    return "".join(texts)


def prompt_messages(
    instructions: str | None, history: Sequence[ChatMessage], turn: Sequence[ChatMessage]
) -> list[ChatMessage]:
    """Instructions (not carried over from a previous response) as the system message, then
    the stored conversation, then this request's turns."""
    system = [] if instructions is None else [ChatMessage("system", instructions)]
    return [*system, *history, *turn]


def response_usage(usage: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(),
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
    )


def status_of(reason: FinishReason) -> tuple[str, IncompleteDetails | None]:
    """(response status, incomplete details) of a finished generation."""
    if reason is FinishReason.LENGTH:
        return "incomplete", IncompleteDetails("max_output_tokens")
    if reason in (FinishReason.ABORT, FinishReason.ERROR):
        return "failed", None
    return "completed", None
