"""Anthropic request fields -> engine inputs, and engine results -> Anthropic pieces.

Usage follows Anthropic's accounting: `input_tokens` are the prompt tokens computed for this
request, `cache_read_input_tokens` those served from the prefix cache (their sum is the prompt
length); the cache fills automatically, so `cache_creation_input_tokens` is 0.
"""

from __future__ import annotations

import msgspec

from deepinfer.api.anthropic.schemas import (
    ContentBlockIn,
    CountTokensRequest,
    DeltaUsage,
    MessagesRequest,
    UsageOut,
)
from deepinfer.api.anthropic.tools import block_turns
from deepinfer.api.http.errors import ApiError, ErrorKind
from deepinfer.api.prompt_options import PromptOptions
from deepinfer.api.tools.structured import anthropic_spec
from deepinfer.engine.types import Usage
from deepinfer.errors import InvalidRequestError
from deepinfer.request import FinishReason, SamplingParams
from deepinfer.text.recipe import ChatMessage

_ROLES = ("user", "assistant")


def invalid(param: str, message: str) -> ApiError:
    return ApiError(ErrorKind.INVALID_REQUEST, f"{param}: {message}", param=param)


def _text(content: str | list[ContentBlockIn], param: str) -> str:
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, block in enumerate(content):
        if block.type != "text":
            raise invalid(
                f"{param}[{j}].type", f"unsupported content block {block.type!r}; use 'text'"
            )
        if block.text is None:
            raise invalid(f"{param}[{j}].text", "a text block needs text")
        texts.append(block.text)
    return "".join(texts)


def chat_messages(req: CountTokensRequest) -> list[ChatMessage]:
    """System prompt first (string or text blocks), then the turns; 400 naming bad fields."""
    if not req.messages:
        raise invalid("messages", "must hold at least one message")
    out: list[ChatMessage] = []
    if req.system is not None:
        out.append(ChatMessage("system", _text(req.system, "system")))
    declared: set[str] = set()  # the tool_use ids so far: a tool_result answers one of them
    for i, m in enumerate(req.messages):
        if m.role not in _ROLES:
            raise invalid(
                f"messages.{i}.role", f"unsupported role {m.role!r}; use 'user' or 'assistant'"
            )
        param = f"messages.{i}.content"
        if isinstance(m.content, str) or all(b.type == "text" for b in m.content):
            out.append(ChatMessage(m.role, _text(m.content, param)))
        else:
            out += block_turns(m.role, m.content, param, declared)
    return out


def prompt_options(req: CountTokensRequest, messages: list[ChatMessage]) -> PromptOptions:
    """A trailing assistant message is a prefill: the answer continues it (Anthropic's rule,
    and its 400 for trailing whitespace there, which a continuation could not follow).
    `thinking` is a reasoning model's switch (absent: the model's default)."""
    thinking = None if req.thinking is None else req.thinking.type == "enabled"
    if not req.messages or req.messages[-1].role != "assistant":
        return PromptOptions(enable_thinking=thinking)
    last = messages[-1]
    if last.role != "assistant" or last.tool_calls:  # a turn of calls is closed as before
        return PromptOptions(enable_thinking=thinking)
    if last.content != last.content.rstrip():
        param = f"messages.{len(req.messages) - 1}.content"
        raise invalid(param, "final assistant content cannot end with trailing whitespace")
    return PromptOptions(False, True, thinking)


def sampling_params(req: MessagesRequest) -> SamplingParams:
    if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
        raise invalid("temperature", f"must be in [0, 1], got {req.temperature}")
    try:
        return SamplingParams(
            max_tokens=req.max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            stop=tuple(req.stop_sequences or ()),
            structured=anthropic_spec(req.output_format, config_format(req)),
        )
    except InvalidRequestError as exc:
        raise ApiError(ErrorKind.INVALID_REQUEST, exc.message, param=exc.param) from None


def config_format(req: CountTokensRequest) -> msgspec.Raw:
    """`output_config.format` as sent (empty: absent)."""
    return msgspec.Raw() if req.output_config is None else req.output_config.format


def stop_reason(
    reason: FinishReason, stop: str | int | None, stops: list[str] | None, num_calls: int = 0
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a finished request (`tool_use` after calls)."""
    if reason is FinishReason.STOP and num_calls:
        return "tool_use", None
    if reason is FinishReason.LENGTH:
        return "max_tokens", None
    if isinstance(stop, str) and stops and stop in stops:
        return "stop_sequence", stop
    return "end_turn", None


def usage_out(usage: Usage) -> UsageOut:
    return UsageOut(
        input_tokens=usage.prompt_tokens - usage.cached_tokens,
        output_tokens=usage.completion_tokens,
        cache_creation_input_tokens=0,
        cache_read_input_tokens=usage.cached_tokens,
    )


def delta_usage(usage: Usage) -> DeltaUsage:
    u = usage_out(usage)
    return DeltaUsage(u.output_tokens, u.input_tokens, 0, u.cache_read_input_tokens)
