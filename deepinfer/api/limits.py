"""The server's request limits (`RequestLimits`), checked right after a body is decoded and
before any work proportional to what each one bounds (rendering messages, building stop-string
matchers, tokenizing). A request over a limit gets a 400 naming the field and the limit.

The nesting depth of the JSON itself is checked earlier, on the raw body (`http/body.py`).
"""

from __future__ import annotations

from collections.abc import Sized

import msgspec

from deepinfer.api.anthropic.schemas import CountTokensRequest, MessagesRequest
from deepinfer.api.http.errors import ApiError, ErrorKind
from deepinfer.api.openai.schemas import ChatCompletionRequest, _SamplingFields
from deepinfer.api.responses.schemas import ResponsesRequest
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
    _check_constraint_bytes(req, limits)


def _check_constraint_bytes(req: _SamplingFields, limits: RequestLimits) -> None:
    """vLLM's constraints: each one's text (a schema, a regex, a grammar, the choices) is sized
    against `max_schema_bytes` like a response format's schema."""
    _check_schema_bytes("guided_json", len(req.guided_json), limits)
    _check_schema_bytes("structured_outputs", len(req.structured_outputs), limits)
    if req.guided_regex is not None:
        _check_schema_bytes("guided_regex", _utf8_bytes(req.guided_regex), limits)
    if req.guided_choice is not None:
        num_bytes = sum(_utf8_bytes(choice) + 3 for choice in req.guided_choice)
        _check_schema_bytes("guided_choice", num_bytes, limits)


def _utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_openai_chat(req: ChatCompletionRequest, limits: RequestLimits) -> None:
    _check_messages(req.messages, limits)
    check_openai_sampling(req, limits)
    check_tools(req.tools, limits)
    _check_schema_bytes("response_format", len(req.response_format), limits)


def check_anthropic(req: CountTokensRequest, limits: RequestLimits) -> None:
    """A Messages or count_tokens request."""
    _check_messages(req.messages, limits)
    check_tools(req.tools, limits)
    if req.output_config is not None:
        _check_schema_bytes("output_config.format", len(req.output_config.format), limits)
    if isinstance(req, MessagesRequest):
        _check_stops("stop_sequences", req.stop_sequences, limits)
        _check_schema_bytes("output_format", len(req.output_format), limits)


def check_responses(req: ResponsesRequest, limits: RequestLimits) -> None:
    """`input` items (as messages), `tools`, and the schema of a `text.format`. The other
    bounded fields (stop strings, stop token ids, logit biases) have no Responses field."""
    if isinstance(req.input, list):
        n = limits.max_messages
        _check_count("input", req.input, n, f"{n} items", "max_messages")
    check_tools(req.tools, limits)
    fmt = None if req.text is None else req.text.format
    if fmt is not None:
        _check_schema_bytes("text.format.schema", len(fmt.schema_), limits)


def check_sequences(num_sequences: int, param: str, max_waiting: int) -> None:
    """A request of more sequences (prompts times `n`) than the engine ever queues can never
    be admitted whole: a 400, not the 429 of a queue that is full for now."""
    if num_sequences > max_waiting:
        accepted = f"{max_waiting} sequences"
        raise over_limit(param, accepted, "max_waiting", num_sequences)


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


def check_tools(tools: list[msgspec.Raw] | None, limits: RequestLimits) -> None:
    """The number of tools and the bytes of their JSON."""
    n = limits.max_tools
    _check_count("tools", tools, n, f"{n} tools", "max_tools")
    if tools:
        _check_schema_bytes("tools", sum(len(t) for t in tools), limits)


def _check_schema_bytes(param: str, num_bytes: int, limits: RequestLimits) -> None:
    limit = limits.max_schema_bytes
    if num_bytes > limit:
        raise over_limit(param, f"{limit} bytes of JSON", "max_schema_bytes", num_bytes)
