"""Anthropic-compatible routes: POST /v1/messages (streaming and not), /v1/messages/count_tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from deepinfer.api.anthropic.convert import (
    chat_messages,
    config_format,
    delta_usage,
    prompt_options,
    sampling_params,
    stop_reason,
    usage_out,
)
from deepinfer.api.anthropic.schemas import (
    CountTokensRequest,
    Message,
    MessageDelta,
    MessagesRequest,
    MessageStart,
    MessageStop,
    Ping,
    StopDelta,
    TextBlock,
    ThinkingBlock,
    TokenCount,
    ToolUseBlock,
    check_refused,
    reasoning_effort,
)
from deepinfer.api.anthropic.tools import (
    TOOL_ID_PREFIX,
    BlockEvents,
    answer_blocks,
    anthropic_plan,
    event_name,
)
from deepinfer.api.context import ApiContext, new_id
from deepinfer.api.http.body import json_response
from deepinfer.api.http.cache_options import cache_options
from deepinfer.api.http.errors import anthropic_error_response, anthropic_payload, to_api_error
from deepinfer.api.http.sse import EventStreamResponse, event_frame, unless_disconnected
from deepinfer.api.limits import check_anthropic
from deepinfer.api.protocol import OutputStream
from deepinfer.api.reasoning import reasoning_plan
from deepinfer.api.streams import collect
from deepinfer.api.tools.grammar import answer_constraint, recipe_format
from deepinfer.api.tools.plan import ToolPlan, ToolStream
from deepinfer.api.tools.structured import anthropic_spec
from deepinfer.engine.types import Usage
from deepinfer.text.reasoning import ReasoningSplitter

Handler = Callable[[Request], Awaitable[Response]]

CLIENT_CLOSED = 499


def anthropic_routes(ctx: ApiContext) -> list[Route]:
    return [
        Route("/v1/messages", _messages_handler(ctx), methods=["POST"]),
        Route("/v1/messages/count_tokens", _count_handler(ctx), methods=["POST"]),
    ]


def _count_handler(ctx: ApiContext) -> Handler:
    async def count_tokens(request: Request) -> Response:
        try:
            ctx.check_running()
            req = await ctx.read_json(request, CountTokensRequest)
            check_refused(req, None)
            check_anthropic(req, ctx.limits)
            anthropic_spec(msgspec.Raw(), config_format(req))  # checked; it adds no tokens
            specs = anthropic_plan(req).specs
            messages = chat_messages(req)
            effort = reasoning_effort(req)
            options = prompt_options(req, messages)
            ids = await ctx.encode_chat(
                messages, effort, within_context=False, tools=specs, options=options
            )
        except Exception as exc:
            return anthropic_error_response(exc)
        return json_response(TokenCount(len(ids)))

    return count_tokens


def _messages_handler(ctx: ApiContext) -> Handler:
    async def messages(request: Request) -> Response:
        try:
            ctx.check_running()
            req = await ctx.read_json(request, MessagesRequest)
            check_refused(req, req.metadata)
            check_anthropic(req, ctx.limits)
            plan = anthropic_plan(req).written_in(recipe_format(ctx.engine.recipe))
            messages = chat_messages(req)
            options = prompt_options(req, messages)
            reasoning = reasoning_plan(ctx.engine.recipe, options)
            ids = await ctx.encode_chat(
                messages, reasoning_effort(req), tools=plan.specs, options=options
            )
            params = ctx.chat_sampling(sampling_params(req))
            params = answer_constraint(params, plan, recipe_format(ctx.engine.recipe))
            mid = new_id("msg_")
            cache = cache_options(request, req.cache_salt, req.cache_retention)
            (stream,) = await ctx.submit_all([ids], [params], request_id=mid, cache=cache)
        except Exception as exc:
            return anthropic_error_response(exc)
        if req.stream:
            events = _events(ctx, mid, stream, req, plan, reasoning.splitter(ctx.engine.tokenizer))
            return EventStreamResponse(events, stream.aclose)
        try:
            done, result = await unless_disconnected(request.receive, collect(stream))
        except Exception as exc:
            return anthropic_error_response(exc)
        if not done or result is None:
            await stream.aclose()
            return Response(status_code=CLIENT_CLOSED)
        tools = ToolStream(plan, TOOL_ID_PREFIX) if plan.parses_calls else None
        splitter = reasoning.splitter(ctx.engine.tokenizer)
        text, thought = result.text, None
        if splitter is not None:
            thought, text = splitter.feed_parts(result.text, result.token_ids)
        content: list[ThinkingBlock | TextBlock | ToolUseBlock] = []
        if splitter is not None and splitter.has_block:
            content.append(ThinkingBlock(thought or ""))
        content += answer_blocks(text, tools)
        num_calls = 0 if tools is None else tools.num_calls
        reason, sequence = stop_reason(
            result.finish_reason, result.stop_reason, req.stop_sequences, num_calls
        )
        message = Message(
            id=mid,
            model=ctx.model_name,
            content=content,
            stop_reason=reason,
            stop_sequence=sequence,
            usage=usage_out(result.usage),
        )
        return json_response(message)

    return messages


async def _events(
    ctx: ApiContext,
    mid: str,
    stream: OutputStream,
    req: MessagesRequest,
    plan: ToolPlan,
    splitter: ReasoningSplitter | None,
) -> AsyncIterator[bytes]:
    """message_start, content_block_start, ping, content_block_delta*, content_block_stop,
    message_delta (stop reason and final usage), message_stop. With tools or a reasoning
    model (`splitter`), blocks open as the answer needs them (`BlockEvents`): a thinking
    block (`thinking_delta`s), text, then a tool_use block per call.

    message_start is sent at once, before the prefix-cache lookup is known; message_delta carries
    the final cumulative usage, cache reads included."""
    usage = Usage(stream.num_prompt_tokens, 0, 0)
    start = Message(mid, ctx.model_name, [], None, None, usage_out(usage))
    yield event_frame("message_start", MessageStart(start))
    tools = ToolStream(plan, TOOL_ID_PREFIX) if plan.parses_calls else None
    blocks = BlockEvents(tools)
    if tools is None and splitter is None:
        for event in blocks.open_text():
            yield event_frame(event_name(event), event)
    yield event_frame("ping", Ping())
    try:
        async for out in stream:
            usage = out.usage
            text = out.text
            if splitter is not None:
                thought, text = splitter.feed_parts(out.text, out.token_ids)
                for event in blocks.thinking(thought) if thought else ():
                    yield event_frame(event_name(event), event)
            for event in blocks.events(text, out.finish_reason is not None):
                yield event_frame(event_name(event), event)
            if out.finish_reason is not None:
                num_calls = 0 if tools is None else tools.num_calls
                reason, sequence = stop_reason(
                    out.finish_reason, out.stop_reason, req.stop_sequences, num_calls
                )
                yield event_frame(
                    "message_delta", MessageDelta(StopDelta(reason, sequence), delta_usage(usage))
                )
                yield event_frame("message_stop", MessageStop())
    except Exception as exc:
        yield event_frame("error", anthropic_payload(to_api_error(exc)))
