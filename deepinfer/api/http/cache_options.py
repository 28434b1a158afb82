"""Per-request prefix-cache options: retention class and tenant salt; OpenAI's session hints.

The salt isolates tenants: it is mixed into the first block's hash, so two salts share no cached
block and cannot probe each other's prefixes. A presented API key's identity (a digest, never the
key) is part of the salt, whatever the body says. Salts live in two domains that never meet: one
derived from a key is `key:<digest>|<body salt>`, one from the body alone is `user:<body salt>`,
so no body can spell another tenant's key-derived salt.

OpenAI's `prompt_cache_retention` maps onto the retention classes (`PROMPT_CACHE_RETENTION`):
`in_memory` keeps the prompt's blocks in device memory only (`none`: LRU there, never offered
to the host or disk tier), `24h` keeps them on disk (`agent`, the shorter class: 3 days by
default, at least the 24 hours asked for). `prompt_cache_key` changes nothing here (the cache is
keyed by content, and isolation is the salt's job); it is echoed in the `x-prompt-cache-key`
response header (`PromptCacheKeyMiddleware`), where a router in front can read it as a sticky
session key without parsing bodies.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from urllib.parse import quote

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepinfer.api.http.auth import presented_key
from deepinfer.config import Retention
from deepinfer.errors import InvalidRequestError

RETENTION_HEADER = "x-cache-retention"
PROMPT_CACHE_KEY_HEADER = "x-prompt-cache-key"
PROMPT_CACHE_RETENTION = {"in_memory": Retention.NONE, "24h": Retention.AGENT}
"""OpenAI's `prompt_cache_retention` values -> retention class."""
MAX_PROMPT_CACHE_KEY_CHARS = 1024
_KEY_STATE = "prompt_cache_key"
_PRINTABLE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")


@dataclass(frozen=True)
class CacheOptions:
    salt: str | None
    retention: str | None
    """`agent`, `chat` or `none`; None: the server default. The engine validates it."""


def cache_options(
    request: Request,
    salt: str | None,
    retention: str | None,
    prompt_cache_key: str | None = None,
    prompt_cache_retention: str | None = None,
) -> CacheOptions:
    """The request's options: the body's `cache_retention`, else OpenAI's
    `prompt_cache_retention` mapped, else the `x-cache-retention` header; the key noted for the
    response header."""
    if prompt_cache_retention is not None and prompt_cache_retention not in PROMPT_CACHE_RETENTION:
        raise InvalidRequestError(
            f"prompt_cache_retention must be one of {', '.join(PROMPT_CACHE_RETENTION)}, "
            f"got {prompt_cache_retention!r}",
            param="prompt_cache_retention",
        )
    if prompt_cache_key is not None:
        if len(prompt_cache_key) > MAX_PROMPT_CACHE_KEY_CHARS:
            raise InvalidRequestError(
                f"prompt_cache_key is longer than {MAX_PROMPT_CACHE_KEY_CHARS} characters",
                param="prompt_cache_key",
            )
        request.state.prompt_cache_key = prompt_cache_key
    mapped = PROMPT_CACHE_RETENTION.get(prompt_cache_retention or "")
    retention = retention or mapped or request.headers.get(RETENTION_HEADER)
    return CacheOptions(salt=cache_salt(presented_key(request.headers), salt), retention=retention)


class PromptCacheKeyMiddleware:
    """Echo a request's `prompt_cache_key` in the `x-prompt-cache-key` response header
    (printable ASCII as sent, other characters percent-encoded; `%` too, so it decodes back)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})

        async def send_with_key(message: Message) -> None:
            key = state.get(_KEY_STATE) if isinstance(state, dict) else None
            if message["type"] == "http.response.start" and key is not None:
                value = quote(key, safe=_PRINTABLE).encode("ascii")
                headers = [*message.get("headers", ()), (PROMPT_CACHE_KEY_HEADER.encode(), value)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_key)


def cache_salt(key: str | None, body_salt: str | None) -> str | None:
    """The engine's salt for a request: None (shared cache) without key or body salt."""
    if key:
        tenant = hashlib.sha256(key.encode()).hexdigest()[:32]
        return f"key:{tenant}|{body_salt or ''}"
    return None if body_salt is None else f"user:{body_salt}"
