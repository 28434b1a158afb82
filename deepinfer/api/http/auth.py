"""Optional API key: `Authorization: Bearer <key>` or `x-api-key: <key>`, compared in constant
time. /health stays open so that orchestrators can probe the server, and the web pages (static files
without data, which call the API with the key) are served to anyone."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from deepinfer.api.http.errors import ApiError, ErrorKind, error_response_for
from deepinfer.api.ops.pages import is_page_path

OPEN_PATHS = frozenset({"/health"})


def route_path(scope: Scope) -> str:
    """The path inside this app (a host app may mount it under a prefix)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def presented_key(headers: Headers) -> str | None:
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer":
            return token.strip()
    return headers.get("x-api-key")


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, pages: bool = False) -> None:
        self.app = app
        self._key = api_key.encode()
        self._pages = pages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if path in OPEN_PATHS or (self._pages and is_page_path(path)):
            await self.app(scope, receive, send)
            return
        key = presented_key(Headers(scope=scope))
        if key is not None and hmac.compare_digest(key.encode(), self._key):
            await self.app(scope, receive, send)
            return
        err = ApiError(
            ErrorKind.AUTHENTICATION,
            "missing or invalid API key: send `Authorization: Bearer <key>` or `x-api-key`",
            code="invalid_api_key",
        )
        await error_response_for(path, err)(scope, receive, send)
