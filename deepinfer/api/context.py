"""What every route needs: the engine, the metrics, limits; and the shared submit path."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import Request

from deepinfer.api.http.body import decode_json, read_body
from deepinfer.api.http.cache_options import CacheOptions
from deepinfer.api.http.errors import ApiError, ErrorKind
from deepinfer.api.limits import check_sequences
from deepinfer.api.ops.metrics import ApiMetrics
from deepinfer.api.prompt_options import DEFAULT_PROMPT, PromptOptions
from deepinfer.api.protocol import EngineClient, OutputStream
from deepinfer.api.streams import close_all
from deepinfer.engine.prompts import check_prompt_fits, off_loop
from deepinfer.kv_transfer.params import KVTransferParams
from deepinfer.request import SamplingParams
from deepinfer.server_config import RequestLimits
from deepinfer.text.recipe import ChatMessage, ToolSpec

T = TypeVar("T")

MAX_CHOICES = 16


@dataclass(frozen=True)
class ApiContext:
    engine: EngineClient
    metrics: ApiMetrics
    served_model_name: str | None
    max_body_bytes: int
    limits: RequestLimits = field(default_factory=RequestLimits)

    @property
    def model_name(self) -> str:
        """The name reported to clients: --served-model-name, else the engine's model."""
        return self.served_model_name or self.engine.model_name

    def check_running(self) -> None:
        if not self.engine.is_running:
            reason = self.engine.dead_reason
            why = f"stopped: {reason}" if reason else "starting or stopped"
            raise ApiError(ErrorKind.UNAVAILABLE, f"the engine is not running ({why})")

    async def read_json(self, request: Request, type_: type[T]) -> T:
        """The body, size- and depth-checked, decoded as `type_`; 400/413 naming the problem."""
        body = await read_body(request, self.max_body_bytes)
        return decode_json(body, type_, max_json_depth=self.limits.max_json_depth)

    async def encode_text(self, text: str) -> list[int]:
        """Ids of a completion prompt; one that cannot fit the context is refused untokenized."""
        self._check_fits([text], "prompt")
        recipe = self.engine.recipe
        return await off_loop(len(text), lambda: recipe.encode_prompt(text))

    async def encode_chat(
        self,
        messages: Sequence[ChatMessage],
        reasoning_effort: str | None,
        *,
        within_context: bool = True,
        tools: Sequence[ToolSpec] = (),
        options: PromptOptions = DEFAULT_PROMPT,
    ) -> list[int]:
        """Ids of a conversation (and the tools it may call), ending as `options` say; with
        `within_context`, one that cannot fit the context is refused untokenized (token
        counting passes False)."""
        texts = [m.content for m in messages] + [m.name for m in messages if m.name]
        texts += [c.arguments for m in messages for c in m.tool_calls]
        texts += [t.definition for t in tools]
        if within_context:
            self._check_fits(texts, "messages")
        recipe = self.engine.recipe
        return await off_loop(
            sum(len(t) for t in texts),
            lambda: recipe.encode(
                messages,
                add_generation_prompt=options.add_generation_prompt,
                reasoning_effort=reasoning_effort,
                tools=tools,
                continue_final_message=options.continue_final_message,
                enable_thinking=options.enable_thinking,
            ),
        )

    def chat_sampling(self, params: SamplingParams) -> SamplingParams:
        """`params` for a chat answer: they stop at the recipe's turn stops too (a template-less
        transcript's next-turn label)."""
        return params.with_turn_stops(self.engine.recipe.turn_stops)

    def _check_fits(self, texts: Sequence[str], param: str) -> None:
        max_token_bytes = self.engine.tokenizer.max_token_bytes
        check_prompt_fits(texts, max_token_bytes, self.engine.max_model_len, param)

    async def submit_all(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        *,
        request_id: str,
        cache: CacheOptions | None = None,
        param: str = "n",
        prediction: str | None = None,
        kv_transfer: KVTransferParams | None = None,
    ) -> list[OutputStream]:
        """Submit one engine request per (prompt, params) pair, all or none: if one is refused,
        those already queued are aborted and the error propagates (before any output). More
        pairs than the engine ever queues is a 400 naming `param`, before any is submitted."""
        check_sequences(len(prompts), param, self.engine.max_waiting)
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
                    prediction=prediction,
                    kv_transfer=kv_transfer if i == 0 else None,  # one hold, one pull a request
                )
                streams.append(self.metrics.track(stream, arrival_s))
        except BaseException:
            await close_all(streams)
            raise
        return streams


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
