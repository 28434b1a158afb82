"""OpenAI Responses API: POST /v1/responses (streaming and not), with `previous_response_id`
continuing a stored conversation; GET and DELETE /v1/responses/{id} on a stored response.
Errors use OpenAI's envelope (the Responses API's own)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from deepinfer.api.context import ApiContext, default_max_tokens, new_id
from deepinfer.api.http.auth import presented_key
from deepinfer.api.http.body import json_response
from deepinfer.api.http.cache_options import cache_options, cache_salt
from deepinfer.api.http.errors import ApiError, ErrorKind, openai_error_response
from deepinfer.api.http.sse import EventStreamResponse, unless_disconnected
from deepinfer.api.limits import check_responses
from deepinfer.api.prompt_options import DEFAULT_PROMPT
from deepinfer.api.reasoning import reasoning_plan
from deepinfer.api.responses.convert import input_messages, invalid, prompt_messages, status_of
from deepinfer.api.responses.fields import check_fields, reasoning_effort
from deepinfer.api.responses.items import whole_answer
from deepinfer.api.responses.schemas import DeletedResponse, ResponsesRequest
from deepinfer.api.responses.store import ResponseStore
from deepinfer.api.responses.stream import Pending, response_events
from deepinfer.api.responses.tools import responses_plan, text_format_spec
from deepinfer.api.streams import collect
from deepinfer.api.tools.grammar import answer_constraint, recipe_format
from deepinfer.config import DiskCacheConfig, Retention
from deepinfer.errors import InvalidRequestError
from deepinfer.request import SamplingParams
from deepinfer.server_config import StoredResponseLimits
from deepinfer.text.recipe import ChatMessage

Handler = Callable[[Request], Awaitable[Response]]

CLIENT_CLOSED = 499
DAY_S = 86_400.0


def responses_routes(
    ctx: ApiContext, disk_cache: DiskCacheConfig, stored: StoredResponseLimits
) -> list[Route]:
    store = new_store(disk_cache, stored)
    return [
        Route("/v1/responses", _create_handler(ctx, store), methods=["POST"]),
        Route("/v1/responses/{response_id}", _stored_handler(store), methods=["GET", "DELETE"]),
    ]


def new_store(disk: DiskCacheConfig, stored: StoredResponseLimits) -> ResponseStore:
    """A store whose retention lifetimes are the disk tier's retention classes."""
    lifetimes_s: dict[str, float] = {
        Retention.AGENT: disk.agent_days * DAY_S,
        Retention.CHAT: disk.chat_days * DAY_S,
    }
    return ResponseStore(lifetimes_s, disk.default_retention, limits=stored)


def _create_handler(ctx: ApiContext, store: ResponseStore) -> Handler:
    async def create_response(request: Request) -> Response:
        try:
            ctx.check_running()
            req = await ctx.read_json(request, ResponsesRequest)
            pending = await _prepare(ctx, store, request, req)
            params = ctx.chat_sampling(_sampling_params(ctx, req, pending.num_prompt_ids))
            params = answer_constraint(params, pending.plan, recipe_format(ctx.engine.recipe))
            cache = pending.cache
            (stream,) = await ctx.submit_all(
                [pending.prompt_ids], [params], request_id=pending.response_id, cache=cache
            )
        except Exception as exc:
            return openai_error_response(exc)
        tok = ctx.engine.tokenizer
        reasoning = reasoning_plan(ctx.engine.recipe, DEFAULT_PROMPT)
        if req.stream:
            events = response_events(pending, stream, store, reasoning.splitter(tok))
            return EventStreamResponse(events, stream.aclose)
        try:
            done, result = await unless_disconnected(request.receive, collect(stream))
        except Exception as exc:
            return openai_error_response(exc)
        if not done or result is None:
            await stream.aclose()
            return Response(status_code=CLIENT_CLOSED)
        status, _ = status_of(result.finish_reason)
        output = whole_answer(
            pending.plan, pending.message_id, result.text, status,
            reasoning.splitter(tok), result.token_ids,
        )  # fmt: skip
        body = pending.finish(output, result.finish_reason, result.usage, store)
        return json_response(body)

    return create_response


def _stored_handler(store: ResponseStore) -> Handler:
    """GET: the stored response object, as its create call answered it; DELETE: forget it.
    Unknown, expired, unstored (`store: false`, retention `none`) or another tenant's: 404. The
    tenant is the API key's identity and the `cache_salt` query parameter, as at creation."""

    async def stored(request: Request) -> Response:
        response_id: str = request.path_params["response_id"]
        try:
            _check_retrieve_query(request)
            salt = cache_salt(
                presented_key(request.headers), request.query_params.get("cache_salt")
            )
            entry = store.get(response_id, salt)
            if entry is None or not entry.body:
                raise ApiError(
                    ErrorKind.NOT_FOUND,
                    f"no stored response with id {response_id!r}",
                    param="response_id",
                )
        except Exception as exc:
            return openai_error_response(exc)
        if request.method == "DELETE":
            store.delete(response_id, salt)
            return json_response(DeletedResponse(response_id))
        return Response(entry.body, media_type="application/json")

    return stored


def _check_retrieve_query(request: Request) -> None:
    query = request.query_params
    if query.get("stream", "false").lower() not in ("false", "0"):
        raise invalid("stream", "a stored response is retrieved whole, not streamed")
    if query.get("include"):
        raise invalid("include", "not supported by this server")


async def _prepare(
    ctx: ApiContext, store: ResponseStore, request: Request, req: ResponsesRequest
) -> Pending:
    """Check the fields, rebuild the conversation and encode the prompt."""
    check_fields(req)
    check_responses(req, ctx.limits)
    cache = cache_options(
        request,
        req.cache_salt,
        req.cache_retention,
        req.prompt_cache_key,
        req.prompt_cache_retention,
    )
    history = _history(store, req.previous_response_id, cache.salt)
    conversation = (*history, *input_messages(req.input))
    messages = prompt_messages(req.instructions, (), conversation)
    plan = responses_plan(req).written_in(recipe_format(ctx.engine.recipe))
    ids = await ctx.encode_chat(messages, reasoning_effort(req), tools=plan.specs)
    return Pending(
        response_id=new_id("resp_"),
        message_id=new_id("msg_"),
        created_at=int(time.time()),
        model=ctx.model_name,
        req=req,
        conversation=conversation,
        cache=cache,
        prompt_ids=ids,
        plan=plan,
    )


def _history(
    store: ResponseStore, response_id: str | None, salt: str | None
) -> tuple[ChatMessage, ...]:
    if response_id is None:
        return ()
    stored = store.get(response_id, salt)
    if stored is None:
        raise ApiError(
            ErrorKind.NOT_FOUND,
            f"previous_response_id: no stored response with id {response_id!r}",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return stored.messages


def _sampling_params(ctx: ApiContext, req: ResponsesRequest, num_prompt_ids: int) -> SamplingParams:
    max_tokens = req.max_output_tokens
    if max_tokens is not None and max_tokens < 1:
        raise invalid("max_output_tokens", f"must be at least 1, got {max_tokens}")
    if max_tokens is None:
        max_tokens = default_max_tokens(ctx.engine.max_model_len, num_prompt_ids)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            structured=text_format_spec(req),
        )
    except InvalidRequestError as exc:
        raise ApiError(ErrorKind.INVALID_REQUEST, exc.message, param=exc.param) from None
