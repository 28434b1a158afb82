"""The server's request limits (`RequestLimits`), checked right after a body is decoded and
before any work proportional to what each one bounds (rendering messages, building stop-string
matchers, tokenizing). A request over a limit gets a 400 naming the field and the limit.

The nesting depth of the JSON itself is checked earlier, on the raw body (`body.py`).
"""

from __future__ import annotations

from collections.abc import Sized

import msgspec

from deepinfer.api.anthropic_schemas import CountTokensRequest, MessagesRequest
from deepinfer.api.errors import ApiError, ErrorKind
from deepinfer.api.openai_schemas import ChatCompletionRequest, _SamplingFields
from deepinfer.server_config import RequestLimits


def over_limit(param: str, accepted: str, limit_name: str, got: int) -> ApiError:
    """`<param>: at most <accepted> are accepted (server limit <limit_name>); got <got>`."""
    return ApiError(
        ErrorKind.INVALID_REQUEST,
        f"{param}: at most {accepted} are accepted (server limit {limit_name}); got {got}",
        param=param,
    )


def check_openai_sampling(req: _SamplingFields, limits: RequestLimits) -> None:
    """`stop`, `stop_token_ids` and `logit_bias` of a chat or completion request."""
    _check_stops("stop", req.stop, limits)
    n = limits.max_stop_token_ids
    _check_count(
        "stop_token_ids", req.stop_token_ids, n, f"{n} stop token ids", "max_stop_token_ids"
    )
    n = limits.max_logit_bias
    _check_count("logit_bias", req.logit_bias, n, f"{n} logit biases", "max_logit_bias")


def check_openai_chat(req: ChatCompletionRequest, limits: RequestLimits) -> None:
    _check_messages(req.messages, limits)
    check_openai_sampling(req, limits)
    _check_tools(req.tools, limits)
    _check_schema_bytes("response_format", len(req.response_format), limits)


def check_anthropic(req: CountTokensRequest, limits: RequestLimits) -> None:
    """A Messages or count_tokens request."""
    _check_messages(req.messages, limits)
    _check_tools(req.tools, limits)
    if isinstance(req, MessagesRequest):
        _check_stops("stop_sequences", req.stop_sequences, limits)


def _check_count(
    param: str, items: Sized | None, limit: int, accepted: str, limit_name: str
) -> None:
    if items is not None and len(items) > limit:
        raise over_limit(param, accepted, limit_name, len(items))


def _check_messages(messages: Sized, limits: RequestLimits) -> None:
    n = limits.max_messages
    _check_count("messages", messages, n, f"{n} messages", "max_messages")


def _check_stops(param: str, stops: str | list[str] | None, limits: RequestLimits) -> None:
    """The count first, then each string's length (`stop` may be one string)."""
    if isinstance(stops, str):
        _check_stop_chars(param, stops, limits)
        return
    n = limits.max_stop_strings
    _check_count(param, stops, n, f"{n} stop strings", "max_stop_strings")
    for i, stop in enumerate(stops or ()):
        _check_stop_chars(f"{param}[{i}]", stop, limits)


def _check_stop_chars(param: str, stop: str, limits: RequestLimits) -> None:
    chars = limits.max_stop_string_chars
    if len(stop) > chars:
        accepted = f"{chars} characters per stop string"
        raise over_limit(param, accepted, "max_stop_string_chars", len(stop))


def _check_tools(tools: list[msgspec.Raw] | None, limits: RequestLimits) -> None:
    n = limits.max_tools
    _check_count("tools", tools, n, f"{n} tools", "max_tools")
    if tools:
        _check_schema_bytes("tools", sum(len(t) for t in tools), limits)


def _check_schema_bytes(param: str, num_bytes: int, limits: RequestLimits) -> None:
    limit = limits.max_schema_bytes
    if num_bytes > limit:
        raise over_limit(param, f"{limit} bytes of JSON", "max_schema_bytes", num_bytes)
