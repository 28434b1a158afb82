"""Anthropic Messages API wire types (msgspec): requests, the message, and stream events; the
request fields declared but not honoured, and their 400.

Every body field the official SDK sends is declared here: honoured, refused when set to a value
that would need honouring (`check_refused`), or informational (`INFORMATIONAL_FIELDS`). Unknown
fields are accepted and have no effect (docs/api.md, "Request fields")."""

from __future__ import annotations

from typing import Any

import msgspec

from deepinfer.api.http.errors import is_set, refuse_set, unsupported

# ---- refused fields

_TIERS = (None, "auto", "standard_only")
_SPEEDS = (None, "standard")
EFFORTS = ("low", "medium", "high")
"""`output_config.effort` values honoured (as a reasoning effort line, like OpenAI's)."""

INFORMATIONAL_FIELDS = frozenset({"model", "cache_control"})
"""Accepted and without effect by design: one model is served under any name, and every full
block is cached automatically (`cache_control`, top-level or on blocks)."""


class ThinkingConfig(msgspec.Struct):
    type: str
    budget_tokens: int | None = None


class AnthropicRefusedFields(msgspec.Struct):
    """Messages request fields Anthropic defines that the server does not honour, refused when
    set.

    Declared as the base of the request types, so that a request setting one to a value that
    would need honouring gets a 400 naming it instead of the field being dropped silently.
    `metadata` is accepted with `user_id` only (an opaque end-user id, recorded nowhere: the
    server keeps no per-user state); any other key is refused.
    """

    service_tier: str | None = None
    container: msgspec.Raw = msgspec.Raw()
    mcp_servers: list[msgspec.Raw] | None = None
    context_management: msgspec.Raw = msgspec.Raw()
    diagnostics: msgspec.Raw = msgspec.Raw()
    inference_geo: str | None = None
    speed: str | None = None


class OutputConfig(msgspec.Struct):
    """`output_config`: `format` as `output_format` (structured output), `effort` low, medium or
    high as a reasoning effort; the SDK's `messages.parse(output_format=Model)` sends this."""

    format: msgspec.Raw = msgspec.Raw()
    effort: str | None = None


MIN_THINKING_BUDGET = 1024
"""Anthropic's least `thinking.budget_tokens`."""


def check_refused(req: CountTokensRequest, metadata: dict[str, Any] | None) -> None:
    """400 naming the first field set to a value this server would have to honour, or a
    `thinking` Anthropic would refuse."""
    check_thinking(req.thinking, getattr(req, "max_tokens", None))
    if req.service_tier not in _TIERS:
        raise unsupported("service_tier", "only 'auto' and 'standard_only' are supported")
    if req.speed not in _SPEEDS:
        raise unsupported("speed", "only 'standard' is supported")
    refuse_set(
        {
            "container": is_set(req.container),
            "mcp_servers": bool(req.mcp_servers),
            "context_management": is_set(req.context_management),
            "diagnostics": is_set(req.diagnostics),
            "inference_geo": req.inference_geo is not None,
        },
        "not supported by this server",
    )
    for key in metadata or {}:
        if key != "user_id":
            raise unsupported(f"metadata.{key}", "only metadata.user_id is accepted")


def check_thinking(thinking: ThinkingConfig | None, max_tokens: int | None) -> None:
    """`thinking` as Anthropic takes it: `disabled`, or `enabled` with a budget of at least
    1024 tokens, below `max_tokens`. The budget is not enforced: the model's think block ends
    when the model ends it (or at `max_tokens`)."""
    if thinking is None or thinking.type == "disabled":
        return
    if thinking.type != "enabled":
        raise unsupported("thinking.type", "use 'enabled' or 'disabled'")
    budget = thinking.budget_tokens
    if budget is None or budget < MIN_THINKING_BUDGET:
        raise unsupported("thinking.budget_tokens", f"must be at least {MIN_THINKING_BUDGET}")
    if max_tokens is not None and budget >= max_tokens:
        raise unsupported("thinking.budget_tokens", "must be less than max_tokens")


# ---- requests


class ContentBlockIn(msgspec.Struct):
    """A text, tool_use (assistant) or tool_result (user) block."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[ContentBlockIn] | None = None
    is_error: bool | None = None


class ToolIn(msgspec.Struct):
    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None
    strict: bool | None = None


class ToolChoiceIn(msgspec.Struct):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessageIn(msgspec.Struct):
    role: str
    content: str | list[ContentBlockIn]


class CountTokensRequest(AnthropicRefusedFields, kw_only=True):
    messages: list[MessageIn]
    model: str | None = None
    system: str | list[ContentBlockIn] | None = None
    thinking: ThinkingConfig | None = None
    """A reasoning model's switch (`check_thinking`, `convert.prompt_options`)."""
    tools: list[msgspec.Raw] | None = None
    """Counted and sized against `max_tools` and `max_schema_bytes`, then decoded as `ToolIn`."""
    tool_choice: ToolChoiceIn | None = None
    output_config: OutputConfig | None = None
    cache_control: msgspec.Raw = msgspec.Raw()


def reasoning_effort(req: CountTokensRequest) -> str | None:
    """`output_config.effort` (low, medium, high), or None; other efforts are a 400."""
    effort = None if req.output_config is None else req.output_config.effort
    if effort not in (None, *EFFORTS):
        raise unsupported("output_config.effort", f"must be one of {', '.join(EFFORTS)}")
    return effort


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    cache_salt: str | None = None
    cache_retention: str | None = None
    output_format: msgspec.Raw = msgspec.Raw()
    """{"type": "json_schema", "schema": ...}: structured output (api/tools/structured.py), the
    older spelling of `output_config.format`."""


# ---- responses


class UsageOut(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


class DeltaUsage(msgspec.Struct):
    output_tokens: int
    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


class TextBlock(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking"):
    """A reasoning model's think block; `signature` is empty (nothing is signed here)."""

    thinking: str
    signature: str = ""


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class Message(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    model: str
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: UsageOut
    role: str = "assistant"


class TokenCount(msgspec.Struct):
    input_tokens: int


class MessageStart(msgspec.Struct, tag_field="type", tag="message_start"):
    message: Message


class ContentBlockStart(msgspec.Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ThinkingBlock | TextBlock | ToolUseBlock


class Ping(msgspec.Struct, tag_field="type", tag="ping"):
    pass


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(msgspec.Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockDelta(msgspec.Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: ThinkingDelta | TextDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopDelta(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(msgspec.Struct, tag_field="type", tag="message_delta"):
    delta: StopDelta
    usage: DeltaUsage


class MessageStop(msgspec.Struct, tag_field="type", tag="message_stop"):
    pass
