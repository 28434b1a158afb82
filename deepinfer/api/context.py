"""What every route needs: the engine, the metrics, limits; and the shared submit path."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deepinfer.api.cache_options import CacheOptions
from deepinfer.api.errors import ApiError, ErrorKind
from deepinfer.api.metrics import ApiMetrics
from deepinfer.api.protocol import EngineClient, OutputStream
from deepinfer.api.streams import close_all
from deepinfer.request import SamplingParams
from deepinfer.text.recipe import ChatMessage

_OFFLOAD_CHARS = 16_384
"""Prompts longer than this are tokenized in a worker thread, off the event loop."""

MAX_CHOICES = 16


@dataclass(frozen=True)
class ApiContext:
    engine: EngineClient
    metrics: ApiMetrics
    served_model_name: str | None
    max_body_bytes: int

    @property
    def model_name(self) -> str:
        """The name reported to clients: --served-model-name, else the engine's model."""
        return self.served_model_name or self.engine.model_name

    def check_running(self) -> None:
        if not self.engine.is_running:
            raise ApiError(ErrorKind.UNAVAILABLE, "the engine is not running (starting or stopped)")

    async def encode_text(self, text: str) -> list[int]:
        recipe = self.engine.recipe
        return await _maybe_offload(len(text), lambda: recipe.encode_prompt(text))

    async def encode_chat(
        self, messages: Sequence[ChatMessage], reasoning_effort: str | None
    ) -> list[int]:
        size = sum(len(m.content) for m in messages)
        recipe = self.engine.recipe
        return await _maybe_offload(
            size, lambda: recipe.encode(messages, reasoning_effort=reasoning_effort)
        )

    async def submit_all(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        *,
        request_id: str,
        cache: CacheOptions | None = None,
    ) -> list[OutputStream]:
        """Submit one engine request per (prompt, params) pair, all or none: if one is refused,
        those already queued are aborted and the error propagates (before any output)."""
        arrival_s = time.monotonic()
        streams: list[OutputStream] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                stream = await self.engine.submit(
                    prompt,
                    p,
                    request_id=f"{request_id}-{i}",
                    cache_salt=cache.salt if cache else None,
                    cache_retention=cache.retention if cache else None,
                )
                streams.append(self.metrics.track(stream, arrival_s))
        except BaseException:
            await close_all(streams)
            raise
        return streams


async def _maybe_offload(size: int, fn: Callable[[], list[int]]) -> list[int]:
    if size > _OFFLOAD_CHARS:
        return await asyncio.to_thread(fn)
    return fn()


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def default_max_tokens(max_model_len: int, num_prompt_tokens: int) -> int:
    """What a request without max_tokens may generate: the rest of the context (at least 1, so
    that an over-long prompt gets the engine's context-length error)."""
    return max(1, max_model_len - num_prompt_tokens)


def check_choices(n: int | None) -> int:
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        raise ApiError(
            ErrorKind.INVALID_REQUEST, f"n must be in [1, {MAX_CHOICES}], got {n}", param="n"
        )
    return n
