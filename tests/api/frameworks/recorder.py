"""OpenAI SDK HTTP clients that record each request body a framework sends."""

from __future__ import annotations

from typing import Any

import openai


class Recorder:
    """`bodies`: the JSON text of every request, in order, from the clients made here."""

    def __init__(self) -> None:
        self.bodies: list[str] = []

    def _record(self, request: Any) -> None:
        self.bodies.append(request.content.decode())

    async def _arecord(self, request: Any) -> None:
        self._record(request)

    def http_client(self) -> Any:
        return openai.DefaultHttpxClient(event_hooks={"request": [self._record]})

    def async_http_client(self) -> Any:
        return openai.DefaultAsyncHttpxClient(event_hooks={"request": [self._arecord]})
