"""The server's own web pages: `GET /` (chat playground), `GET /dashboard` (live operations view)
and `GET /static/<file>`, read once from the package (`deepinfer/api/ops/web/`) and served from
memory.

The pages hold no data: they are static files that call the API like any client (with the key
the user types when the server has `--api-key`), so they stay open without the key. Every page
response carries a strict Content-Security-Policy: scripts, styles and connections from this
origin only, no inline script or style, nothing framed, nothing fetched from elsewhere.
"""

from __future__ import annotations

import hashlib
import importlib.resources
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from deepinfer.api.http.errors import ApiError, ErrorKind

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; manifest-src 'self'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)
PAGE_PATHS = frozenset({"/", "/dashboard"})
STATIC_PREFIX = "/static/"

_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
_PAGES = {"/": "chat.html", "/dashboard": "dashboard.html"}


def is_page_path(path: str) -> bool:
    """Paths served without the API key: the pages and their static files (no data in them)."""
    return path in PAGE_PATHS or path.startswith(STATIC_PREFIX)


@dataclass(frozen=True)
class StaticFile:
    body: bytes
    media_type: str
    etag: str


def load_static() -> dict[str, StaticFile]:
    """Every file of the web folder by name (read once: a few tens of kB)."""
    folder = importlib.resources.files("deepinfer.api.ops") / "web"
    files = {}
    for entry in folder.iterdir():
        media_type = _MEDIA_TYPES.get("." + entry.name.rpartition(".")[2])
        if media_type is None or not entry.is_file():
            continue
        body = entry.read_bytes()
        etag = '"' + hashlib.blake2b(body, digest_size=8).hexdigest() + '"'
        files[entry.name] = StaticFile(body, media_type, etag)
    return files


def page_routes() -> list[BaseRoute]:
    files = load_static()

    def serve(request: Request, name: str) -> Response:
        file = files.get(name)
        if file is None:
            raise ApiError(ErrorKind.NOT_FOUND, f"no such file: {request.url.path}")
        headers = {
            "content-security-policy": CONTENT_SECURITY_POLICY,
            "x-content-type-options": "nosniff",
            "referrer-policy": "no-referrer",
            "cache-control": "no-cache",
            "etag": file.etag,
        }
        if request.headers.get("if-none-match") == file.etag:
            return Response(status_code=304, headers=headers)
        return Response(file.body, media_type=file.media_type, headers=headers)

    def page(name: str) -> Callable[[Request], Awaitable[Response]]:
        async def handler(request: Request) -> Response:
            return serve(request, name)

        return handler

    async def static(request: Request) -> Response:
        return serve(request, request.path_params["name"])

    routes: list[BaseRoute] = [
        Route(path, page(name), methods=["GET", "HEAD"]) for path, name in _PAGES.items()
    ]
    return [*routes, Route("/static/{name}", static, methods=["GET", "HEAD"])]
