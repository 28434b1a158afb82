"""vLLM's render endpoints: POST /v1/chat/completions/render and /v1/completions/render answer
with the token ids a request would run (vLLM's `GenerateRequest` shape), without running it.

Routers and schedulers that index KV caches by tokens (vLLM's router, llm-d's token producer)
call them before placing a request; the ids come from the same code as the generating routes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from deepinfer.api.context import ApiContext, check_choices, new_id
from deepinfer.api.http.body import json_response
from deepinfer.api.http.errors import openai_error_response
from deepinfer.api.openai.routes import (
    chat_max_tokens,
    chat_prompt,
    completion_ids,
    completion_max_tokens,
    completion_prompts,
)
from deepinfer.api.openai.schemas import ChatCompletionRequest, CompletionRequest

Handler = Callable[[Request], Awaitable[Response]]


class RenderedSampling(msgspec.Struct, omit_defaults=True):
    """The sampling fields the request set, under vLLM's `SamplingParams` names."""

    max_tokens: int
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None


class Rendered(msgspec.Struct):
    """vLLM's `GenerateRequest`: what the request runs, as ids."""

    request_id: str
    token_ids: list[int]
    sampling_params: RenderedSampling
    model: str | None
    stream: bool
    features: None = None
    cache_salt: str | None = None


def render_routes(ctx: ApiContext) -> list[Route]:
    return [
        Route("/v1/chat/completions/render", _chat_render(ctx), methods=["POST"]),
        Route("/v1/completions/render", _completion_render(ctx), methods=["POST"]),
    ]


def _sampling(req: ChatCompletionRequest | CompletionRequest, max_tokens: int) -> RenderedSampling:
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    return RenderedSampling(
        max_tokens, check_choices(req.n), req.temperature, req.top_p, req.top_k, req.min_p,
        req.seed, stop, req.presence_penalty, req.frequency_penalty, req.repetition_penalty,
    )  # fmt: skip


def _chat_render(ctx: ApiContext) -> Handler:
    async def render(request: Request) -> Response:
        try:
            ctx.check_running()
            req = await ctx.read_json(request, ChatCompletionRequest)
            ids = (await chat_prompt(ctx, req)).ids
            max_tokens = chat_max_tokens(ctx, req, len(ids))
            answer = Rendered(
                new_id("chatcmpl-"), ids, _sampling(req, max_tokens), req.model,
                bool(req.stream), cache_salt=req.cache_salt,
            )  # fmt: skip
        except Exception as exc:
            return openai_error_response(exc)
        return json_response(answer)

    return render


def _completion_render(ctx: ApiContext) -> Handler:
    async def render(request: Request) -> Response:
        try:
            ctx.check_running()
            req = await ctx.read_json(request, CompletionRequest)
            prompts = await completion_ids(ctx, completion_prompts(ctx, req))
            sampling = _sampling(req, completion_max_tokens(req))
            stream = bool(req.stream)
            answer = [
                Rendered(
                    new_id("cmpl-"), ids, sampling, req.model, stream, cache_salt=req.cache_salt
                )
                for ids in prompts
            ]
        except Exception as exc:
            return openai_error_response(exc)
        return json_response(answer)

    return render
