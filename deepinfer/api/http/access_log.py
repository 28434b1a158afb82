"""Structured access logs (one JSON object per request on the `deepinfer.access` logger) and the
request counter by endpoint and status."""

from __future__ import annotations

import json
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepinfer.api.http.auth import route_path
from deepinfer.api.ops.metrics import ApiMetrics

access_log = logging.getLogger("deepinfer.access")

KNOWN_ENDPOINTS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
    }
)


class AccessLogMiddleware:
    """Logs method, endpoint, status, duration and response bytes; a streamed request is logged
    when its stream ends. Status 499 means the client left before the response was sent."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start_s = time.monotonic()
        status = 499
        num_bytes = 0

        async def send_wrapper(message: Message) -> None:
            nonlocal status, num_bytes
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                num_bytes += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException:
            status = 500 if status == 499 else status
            raise
        finally:
            path = route_path(scope)
            endpoint = path if path in KNOWN_ENDPOINTS else "other"
            self.metrics.count_request(endpoint, status)
            if access_log.isEnabledFor(logging.INFO):
                client = scope.get("client")
                record = {
                    "method": scope["method"],
                    "path": path,
                    "status": status,
                    "duration_ms": round((time.monotonic() - start_s) * 1000, 2),
                    "bytes": num_bytes,
                    "client": f"{client[0]}:{client[1]}" if client else None,
                }
                access_log.info(json.dumps(record))
