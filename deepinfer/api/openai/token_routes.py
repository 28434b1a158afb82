"""Token utilities in vLLM's shapes: POST /tokenize (a prompt, or chat messages and the tools
they may call through the recipe, as chat completions encode them), POST /detokenize, and GET /v1/models/{id} (404 in OpenAI's envelope for another id).

Counting is not generating: a prompt longer than the context is tokenized and counted all the
same (the body size bounds the work); long texts are tokenized on the long-text thread.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from deepinfer.api.context import ApiContext
from deepinfer.api.http.body import json_response
from deepinfer.api.http.errors import (
    ApiError,
    ErrorKind,
    is_set,
    openai_error_response,
    refuse_set,
    unsupported,
)
from deepinfer.api.limits import check_tools, over_limit
from deepinfer.api.openai.convert import chat_messages
from deepinfer.api.openai.schemas import ChatMessageIn, ModelCard
from deepinfer.api.openai.tools import tool_specs
from deepinfer.api.prompt_options import openai_prompt_options
from deepinfer.engine.prompts import off_loop
from deepinfer.errors import InvalidRequestError

Handler = Callable[[Request], Awaitable[Response]]
T = TypeVar("T")


INFORMATIONAL_FIELDS = frozenset({"model"})
"""Accepted without effect: one model is served, under any name."""


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """Either `prompt` (raw text) or `messages` (a chat, rendered by the recipe)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool | None = None
    """Prompt: BOS when the model wants one (default True). Chat: the recipe adds them."""
    add_generation_prompt: bool | None = None
    """Default true for `messages` (with `continue_final_message`: false)."""
    return_token_strs: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: msgspec.Raw = msgspec.Raw()
    tools: list[msgspec.Raw] | None = None
    """Function tools in OpenAI's shape, with `messages`: rendered as chat completions do."""
    mm_processor_kwargs: msgspec.Raw = msgspec.Raw()


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


def token_routes(ctx: ApiContext) -> list[Route]:
    return [
        Route("/tokenize", _tokenize_handler(ctx), methods=["POST"]),
        Route("/detokenize", _detokenize_handler(ctx), methods=["POST"]),
        Route("/v1/models/{model_id:path}", _model_handler(ctx), methods=["GET"]),
    ]


def _tokenize_handler(ctx: ApiContext) -> Handler:
    async def tokenize(request: Request) -> Response:
        try:
            ctx.check_running()
            req = await ctx.read_json(request, TokenizeRequest)
            _check_tokenize(req)
            ids = await _token_ids(ctx, req)
            tok = ctx.engine.tokenizer
            strs = (
                await off_loop(len(ids), lambda: [tok.decode([t]) for t in ids])
                if req.return_token_strs
                else None
            )
        except Exception as exc:
            return openai_error_response(exc)
        return json_response(TokenizeResponse(len(ids), ctx.engine.max_model_len, ids, strs))

    return tokenize


def _check_tokenize(req: TokenizeRequest) -> None:
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(
            ErrorKind.INVALID_REQUEST, "give either `prompt` or `messages`", param="prompt"
        )
    refuse_set(
        {
            "continue_final_message": req.prompt is not None and req.continue_final_message,
            "chat_template": req.chat_template is not None,
            "chat_template_kwargs": req.prompt is not None and is_set(req.chat_template_kwargs),
            "mm_processor_kwargs": is_set(req.mm_processor_kwargs),
        },
        "not supported by this server",
    )
    if req.messages is not None and req.add_special_tokens:
        raise unsupported("add_special_tokens", "the chat recipe adds the special tokens")
    if req.prompt is not None and req.add_generation_prompt is False:
        raise unsupported("add_generation_prompt", "applies to `messages` only")
    if req.prompt is not None and req.tools:
        raise unsupported("tools", "apply to `messages` only")


async def _token_ids(ctx: ApiContext, req: TokenizeRequest) -> list[int]:
    recipe, tok = ctx.engine.recipe, ctx.engine.tokenizer
    if req.prompt is not None:
        text = req.prompt
        encode = recipe.encode_prompt if req.add_special_tokens is not False else tok.encode
        return await off_loop(len(text), lambda: encode(text))
    assert req.messages is not None
    n = ctx.limits.max_messages
    if len(req.messages) > n:
        raise over_limit("messages", f"{n} messages", "max_messages", len(req.messages))
    check_tools(req.tools, ctx.limits)
    messages = chat_messages(req.messages)
    tools = tool_specs(req.tools)
    options = openai_prompt_options(
        req.add_generation_prompt,
        req.continue_final_message,
        req.chat_template_kwargs,
        closed_prompts=True,
    )
    size = sum(len(m.content) for m in messages) + sum(len(t.definition) for t in tools)
    return await off_loop(
        size,
        lambda: recipe.encode(
            messages,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            enable_thinking=options.enable_thinking,
            tools=tools,
        ),
    )


def _detokenize_handler(ctx: ApiContext) -> Handler:
    async def detokenize(request: Request) -> Response:
        try:
            ctx.check_running()
            req = await ctx.read_json(request, DetokenizeRequest)
            text = await _decode(ctx, req.tokens)
        except Exception as exc:
            return openai_error_response(exc)
        return json_response(DetokenizeResponse(text))

    return detokenize


async def _decode(ctx: ApiContext, ids: Sequence[int]) -> str:
    tok = ctx.engine.tokenizer
    vocab = tok.vocab_size
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(
            f"tokens[{bad}] is {ids[bad]}, outside the vocabulary [0, {vocab})",
            param=f"tokens[{bad}]",
        )
    return await off_loop(len(ids), lambda: tok.decode(ids))


def _model_handler(ctx: ApiContext) -> Handler:
    created = int(time.time())

    async def model(request: Request) -> Response:
        model_id: str = request.path_params["model_id"]
        if not model_id or model_id.endswith("/"):
            raise HTTPException(404)  # a trailing slash: the app's 404 names the route
        if model_id != ctx.model_name:
            return openai_error_response(
                ApiError(
                    ErrorKind.NOT_FOUND,
                    f"The model {model_id!r} does not exist; this server serves {ctx.model_name!r}",
                    param="model",
                    code="model_not_found",
                )
            )
        return json_response(
            ModelCard(ctx.model_name, created, max_model_len=ctx.engine.max_model_len)
        )

    return model
