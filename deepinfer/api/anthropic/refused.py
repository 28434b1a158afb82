"""Messages request fields Anthropic defines that the server does not honour, refused when set.

Declared as the base of the request types, so that a request setting one to a value that would
need honouring gets a 400 naming it instead of the field being dropped silently. `metadata` is
accepted with `user_id` only (an opaque end-user id, recorded nowhere: the server keeps no
per-user state); any other key is refused.
"""

from __future__ import annotations

from typing import Any

import msgspec

from deepinfer.api.http.unsupported import is_set, refuse_set, unsupported

_TIERS = (None, "auto", "standard_only")


class ThinkingConfig(msgspec.Struct):
    type: str
    budget_tokens: int | None = None


class AnthropicRefusedFields(msgspec.Struct):
    thinking: ThinkingConfig | None = None
    service_tier: str | None = None
    container: msgspec.Raw = msgspec.Raw()
    mcp_servers: list[msgspec.Raw] | None = None
    context_management: msgspec.Raw = msgspec.Raw()


def check_refused(req: AnthropicRefusedFields, metadata: dict[str, Any] | None) -> None:
    """400 naming the first field set to a value this server would have to honour."""
    if req.thinking is not None and req.thinking.type != "disabled":
        raise unsupported("thinking", "extended thinking is not supported; use 'disabled'")
    if req.service_tier not in _TIERS:
        raise unsupported("service_tier", "only 'auto' and 'standard_only' are supported")
    refuse_set(
        {
            "container": is_set(req.container),
            "mcp_servers": bool(req.mcp_servers),
            "context_management": is_set(req.context_management),
        },
        "not supported by this server",
    )
    for key in metadata or {}:
        if key != "user_id":
            raise unsupported(f"metadata.{key}", "only metadata.user_id is accepted")
