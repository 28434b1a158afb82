"""Per-request prefix-cache options: retention class and tenant salt.

The salt isolates tenants: it is mixed into the first block's hash, so two salts share no cached
block and cannot probe each other's prefixes. With API keys on, the key's identity (a digest,
never the key) is part of the salt, whatever the body says.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from starlette.requests import Request

from deepinfer.api.auth import presented_key

RETENTION_HEADER = "x-cache-retention"


@dataclass(frozen=True)
class CacheOptions:
    salt: str | None
    retention: str | None
    """`agent`, `chat` or `none`; None: the server default. The engine validates it."""


def cache_options(request: Request, salt: str | None, retention: str | None) -> CacheOptions:
    key = presented_key(request.headers)
    if key:
        tenant = hashlib.sha256(key.encode()).hexdigest()[:32]
        salt = f"key:{tenant}|{salt or ''}"
    return CacheOptions(salt=salt, retention=retention or request.headers.get(RETENTION_HEADER))
