"""Per-request prefix-cache options: retention class and tenant salt.

The salt isolates tenants: it is mixed into the first block's hash, so two salts share no cached
block and cannot probe each other's prefixes. A presented API key's identity (a digest, never the
key) is part of the salt, whatever the body says. Salts live in two domains that never meet: one
derived from a key is `key:<digest>|<body salt>`, one from the body alone is `user:<body salt>`,
so no body can spell another tenant's key-derived salt.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from starlette.requests import Request

from deepinfer.api.http.auth import presented_key

RETENTION_HEADER = "x-cache-retention"


@dataclass(frozen=True)
class CacheOptions:
    salt: str | None
    retention: str | None
    """`agent`, `chat` or `none`; None: the server default. The engine validates it."""


def cache_options(request: Request, salt: str | None, retention: str | None) -> CacheOptions:
    retention = retention or request.headers.get(RETENTION_HEADER)
    return CacheOptions(salt=cache_salt(presented_key(request.headers), salt), retention=retention)


def cache_salt(key: str | None, body_salt: str | None) -> str | None:
    """The engine's salt for a request: None (shared cache) without key or body salt."""
    if key:
        tenant = hashlib.sha256(key.encode()).hexdigest()[:32]
        return f"key:{tenant}|{body_salt or ''}"
    return None if body_salt is None else f"user:{body_salt}"
