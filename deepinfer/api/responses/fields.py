"""Which Responses request fields are honoured, and the 400 for each one set but not honoured.

Honoured: input (messages, function_call and function_call_output items), instructions,
max_output_tokens, temperature, top_p, metadata, store, stream, previous_response_id,
reasoning.effort (low/medium/high), tools (function tools), tool_choice, parallel_tool_calls,
text.format (`text`, `json_schema`, `json_object`; checked in `tools.py`), truncation
`disabled`, service_tier auto/default, stream_options.include_obfuscation false (no obfuscation
is ever added), prompt_cache_retention (a retention class) and prompt_cache_key (echoed in
the `x-prompt-cache-key` header: `api/http/cache_options.py`), and the deepinfer extensions
cache_salt and cache_retention. Accepted as informational: model (one model is served), user,
safety_identifier. Everything else is refused when set to a non-default value.
"""

from __future__ import annotations

from deepinfer.api.http.errors import is_set, refuse_set, unsupported
from deepinfer.api.responses.schemas import ResponsesRequest

MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

_EFFORTS = ("low", "medium", "high")

INFORMATIONAL_FIELDS = frozenset({"model", "user", "safety_identifier"})
"""Accepted without effect by design: one model is served, the server keeps no per-user state
(`user` is echoed), caching is automatic and keyed by content."""


def check_fields(req: ResponsesRequest) -> None:
    """400 naming the first field set to a value the server would have to honour but does not."""
    refuse_set(
        {
            "background": bool(req.background),
            "conversation": is_set(req.conversation),
            "prompt": is_set(req.prompt),
            "include": bool(req.include),
            "top_logprobs": bool(req.top_logprobs),
            "max_tool_calls": req.max_tool_calls is not None,
            "prompt_cache_options": is_set(req.prompt_cache_options),
            "context_management": is_set(req.context_management),
            "moderation": is_set(req.moderation),
            "image": is_set(req.image),
            "access_programs": is_set(req.access_programs),
            "background_options": is_set(req.background_options),
        },
        "not supported by this server",
    )
    if req.truncation not in (None, "disabled"):
        raise unsupported("truncation", "only 'disabled' is supported (over-long input is a 400)")
    if req.service_tier not in (None, "auto", "default"):
        raise unsupported("service_tier", "only 'auto' and 'default' are supported")
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise unsupported("stream_options.include_obfuscation", "obfuscation is not supported")
    _check_text(req)
    _check_reasoning(req)
    _check_metadata(req.metadata)


def _check_text(req: ResponsesRequest) -> None:
    if req.text is None:
        return
    if req.text.verbosity not in (None, "medium"):
        raise unsupported("text.verbosity", "only 'medium' is supported")


def _check_reasoning(req: ResponsesRequest) -> None:
    if req.reasoning is None:
        return
    if req.reasoning.effort not in (None, *_EFFORTS):
        raise unsupported("reasoning.effort", f"must be one of {', '.join(_EFFORTS)}")
    if req.reasoning.summary is not None or req.reasoning.generate_summary is not None:
        raise unsupported("reasoning.summary", "reasoning summaries are not supported")


def reasoning_effort(req: ResponsesRequest) -> str | None:
    return None if req.reasoning is None else req.reasoning.effort


def _check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512."""
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise unsupported("metadata", f"at most {MAX_METADATA_KEYS} pairs are accepted")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise unsupported("metadata", f"keys are at most {MAX_METADATA_KEY_CHARS} characters")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise unsupported(
                f"metadata.{key}", f"values are at most {MAX_METADATA_VALUE_CHARS} characters"
            )
