"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models; and the token ids
each request runs (`chat_prompt`, `completion_prompts`), shared with the render routes so that
what a router is told a request will run is what it runs."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from deepinfer.api.context import ApiContext, check_choices, default_max_tokens, new_id
from deepinfer.api.http.body import json_response
from deepinfer.api.http.cache_options import cache_options
from deepinfer.api.http.errors import openai_error_response
from deepinfer.api.http.sse import EventStreamResponse, unless_disconnected
from deepinfer.api.limits import check_openai_chat, check_openai_sampling
from deepinfer.api.openai.convert import (
    chat_logprobs,
    chat_messages,
    finish_reason,
    invalid,
    no_output,
    prediction_text,
    sampling_params,
    usage_out,
)
from deepinfer.api.openai.prompt_logprobs import ChoiceText, PromptView, vllm_prompt_logprobs
from deepinfer.api.openai.schemas import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ModelCard,
    ModelList,
    check_refused,
)
from deepinfer.api.openai.streams import chat_frames, completion_frames
from deepinfer.api.openai.tools import CALL_ID_PREFIX, answer_message, openai_plan
from deepinfer.api.prompt_options import PromptOptions, openai_prompt_options
from deepinfer.api.protocol import OutputStream
from deepinfer.api.reasoning import reasoning_plan
from deepinfer.api.streams import Collected, close_all, collect_all, total_usage
from deepinfer.api.tools.grammar import answer_constraint, recipe_format
from deepinfer.api.tools.plan import NO_TOOLS, ToolPlan, ToolStream, called
from deepinfer.errors import PromptTooLongError
from deepinfer.kv_transfer.params import KVTransferParams, parse_params
from deepinfer.text.reasoning import ReasoningSplitter

Handler = Callable[[Request], Awaitable[Response]]

CLIENT_CLOSED = 499
"""Status logged (never sent) when the client went away before a non-streaming answer."""


def openai_routes(ctx: ApiContext) -> list[Route]:
    return [
        Route("/v1/chat/completions", _chat_handler(ctx), methods=["POST"]),
        Route("/v1/completions", _completion_handler(ctx), methods=["POST"]),
        Route("/v1/models", _models_handler(ctx), methods=["GET"]),
    ]


def _models_handler(ctx: ApiContext) -> Handler:
    created = int(time.time())

    async def models(request: Request) -> Response:
        card = ModelCard(ctx.model_name, created, max_model_len=ctx.engine.max_model_len)
        return json_response(ModelList([card]))

    return models


async def _finish(request: Request, streams: list[OutputStream]) -> list[Collected] | None:
    """Collect every stream, or None (requests aborted) if the client disconnects first."""
    done, results = await unless_disconnected(request.receive, collect_all(streams))
    if not done:
        await close_all(streams)
    return results


def _chat_handler(ctx: ApiContext) -> Handler:
    async def chat_completions(request: Request) -> Response:
        try:
            ctx.check_running()
            req = await ctx.read_json(request, ChatCompletionRequest)
            prompt = await chat_prompt(ctx, req)
            ids, plan, options = prompt.ids, prompt.plan, prompt.options
            n = check_choices(req.n)
            max_tokens = chat_max_tokens(ctx, req, len(ids))
            top = (req.top_logprobs or 0) if req.logprobs else None
            if req.top_logprobs is not None and not req.logprobs:
                raise invalid("top_logprobs", "needs logprobs: true")
            if req.prompt_logprobs is not None and req.stream:
                raise invalid("prompt_logprobs", "not supported with stream: true on chat")
            reasoning = reasoning_plan(ctx.engine.recipe, options)
            scored = req.prompt_logprobs
            params = [
                ctx.chat_sampling(
                    sampling_params(
                        req, max_tokens=max_tokens, logprobs=top, choice=i, prompt_logprobs=scored
                    )
                )
                for i in range(n)
            ]
            if plan is not NO_TOOLS:
                fmt = recipe_format(ctx.engine.recipe)
                params = [answer_constraint(p, plan, fmt) for p in params]
            rid = new_id("chatcmpl-")
            cache = cache_options(
                request,
                req.cache_salt,
                req.cache_retention,
                req.prompt_cache_key,
                req.prompt_cache_retention,
            )
            transfer = parse_params(req.kv_transfer_params)
            streams = await ctx.submit_all(
                [ids] * n, params, request_id=rid, cache=cache, prediction=prompt.prediction,
                kv_transfer=transfer,
            )  # fmt: skip
        except Exception as exc:
            return openai_error_response(exc)
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            every = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            frames = chat_frames(
                ctx, rid, created, streams, include_usage, top is not None,
                usage_every_chunk=every, plan=plan, reasoning=reasoning,
            )  # fmt: skip
            return EventStreamResponse(frames, lambda: close_all(streams))
        try:
            results = await _finish(request, streams)
        except Exception as exc:
            return openai_error_response(exc)
        if results is None:
            return Response(status_code=CLIENT_CLOSED)
        tok = ctx.engine.tokenizer
        choices = [
            _chat_choice(
                i, r, plan, chat_logprobs(tok, r.logprobs) if top is not None else None,
                reasoning.splitter(tok),
            )
            for i, r in enumerate(results)
        ]  # fmt: skip
        usage = usage_out(total_usage([r.usage for r in results], 1))
        answer = ChatCompletion(
            rid, created, ctx.model_name, choices, usage,
            system_fingerprint=ctx.engine.system_fingerprint,
        )  # fmt: skip
        if req.prompt_logprobs is not None:
            entries = results[0].prompt_logprobs or ()
            answer.prompt_logprobs = vllm_prompt_logprobs(tok, entries, req.prompt_logprobs)
        if transfer is not None and transfer.do_remote_decode:
            answer.kv_transfer_params = kept_for_consumer(ctx, rid)
        return json_response(answer)

    return chat_completions


def kept_for_consumer(ctx: ApiContext, rid: str) -> KVTransferParams | msgspec.UnsetType:
    """The answer's `kv_transfer_params`: what its first choice kept for a consumer."""
    params = ctx.engine.kv_transfer_params(f"{rid}-0")
    return params if params is not None else msgspec.UNSET


def _chat_choice(
    index: int,
    result: Collected,
    plan: ToolPlan,
    logprobs: ChoiceLogprobs | None,
    splitter: ReasoningSplitter | None,
) -> ChatChoice:
    """A whole answer as a choice: its think block as `reasoning_content`, calls parsed from
    the rest when the request has tools."""
    stream = ToolStream(plan, CALL_ID_PREFIX) if plan.parses_calls else None
    text, reasoning = result.text, None
    if splitter is not None:
        reasoning, text = splitter.feed_parts(result.text, result.token_ids)
        reasoning = reasoning if splitter.has_block else None
    message = answer_message(text, stream)
    message.reasoning_content = reasoning
    reason = finish_reason(result.finish_reason) or "stop"
    if stream is not None and called(result.finish_reason, stream.num_calls):
        reason = "tool_calls"
    return ChatChoice(index, message, reason, logprobs)


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    plan: ToolPlan
    options: PromptOptions
    prediction: str | None = None
    """The request's Predicted Outputs text (`prediction`), drafted from."""


async def chat_prompt(ctx: ApiContext, req: ChatCompletionRequest) -> ChatPrompt:
    """Check a chat request's fields and encode it; 400 in OpenAI's shape on bad input."""
    check_refused(req, chat=True)
    check_openai_chat(req, ctx.limits)
    messages = chat_messages(req.messages)
    options = openai_prompt_options(
        req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs
    )
    plan = NO_TOOLS  # a plain request never enters the tool machinery
    if req.tools or req.tool_choice is not None:
        plan = openai_plan(req).written_in(recipe_format(ctx.engine.recipe))
    prediction = prediction_text(req.prediction)
    ids = await ctx.encode_chat(messages, req.reasoning_effort, tools=plan.specs, options=options)
    return ChatPrompt(ids, plan, options, prediction)


def chat_max_tokens(ctx: ApiContext, req: ChatCompletionRequest, num_prompt: int) -> int:
    """`max_completion_tokens`, else `max_tokens`, else what the context leaves."""
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens
    if req.max_tokens is not None:
        return req.max_tokens
    return default_max_tokens(ctx.engine.max_model_len, num_prompt)


def completion_max_tokens(req: CompletionRequest) -> int:
    return 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default


async def completion_ids(ctx: ApiContext, items: list[str | list[int]]) -> list[list[int]]:
    """Each prompt as ids: texts encoded, ids as given."""
    return [p if isinstance(p, list) else await ctx.encode_text(p) for p in items]


def completion_prompts(ctx: ApiContext, req: CompletionRequest) -> list[str | list[int]]:
    """Check a completion request's fields; its prompts (a batch), each as text or token ids.
    400 in OpenAI's shape on a bad field, mixed or bad items."""
    check_refused(req)
    check_openai_sampling(req, ctx.limits)
    if req.suffix:
        raise invalid("suffix", "suffix is not supported")
    prompt = req.prompt
    items: list[str | list[int]]
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [[p for p in prompt if isinstance(p, int)]]
    elif prompt and all(isinstance(p, str) for p in prompt):
        items = [p for p in prompt if isinstance(p, str)]
    elif prompt and all(isinstance(p, list) for p in prompt):
        items = [p for p in prompt if isinstance(p, list)]
    else:
        raise invalid("prompt", "must be a string, a list of strings, token ids, or lists of ids")
    vocab, max_model_len = ctx.engine.tokenizer.vocab_size, ctx.engine.max_model_len
    for i, item in enumerate(items):
        if len(item) == 0:
            raise invalid("prompt", f"prompt {i} is empty")
        if isinstance(item, list) and len(item) > max_model_len:  # before scanning the ids
            raise PromptTooLongError(len(item), max_model_len, "prompt")
        if isinstance(item, list) and not all(0 <= t < vocab for t in item):
            raise invalid("prompt", f"prompt {i} holds token ids outside [0, {vocab})")
    return items


def _completion_handler(ctx: ApiContext) -> Handler:
    async def completions(request: Request) -> Response:
        try:
            ctx.check_running()
            req = await ctx.read_json(request, CompletionRequest)
            items = completion_prompts(ctx, req)
            prompts = await completion_ids(ctx, items)
            n = check_choices(req.n)
            max_tokens = completion_max_tokens(req)
            views = _prompt_views(ctx, req, items, prompts, max_tokens)
            scored = _num_prompt_scores(req)
            lp, engine_max = req.logprobs, max_tokens or 1  # 0: the prompt's scores alone
            params = [
                sampling_params(
                    req, max_tokens=engine_max, logprobs=lp, choice=i, prompt_logprobs=scored
                )
                for _ in prompts
                for i in range(n)
            ]
            rid = new_id("cmpl-")
            all_prompts = [p for p in prompts for _ in range(n)]
            cache = cache_options(
                request,
                req.cache_salt,
                req.cache_retention,
                req.prompt_cache_key,
                req.prompt_cache_retention,
            )
            param = "prompt" if len(prompts) > 1 else "n"
            transfer = parse_params(req.kv_transfer_params)
            streams = await ctx.submit_all(
                all_prompts, params, request_id=rid, cache=cache, param=param,
                kv_transfer=transfer,
            )  # fmt: skip
        except Exception as exc:
            return openai_error_response(exc)
        created = int(time.time())
        want_lp = req.logprobs is not None
        tok = ctx.engine.tokenizer
        texts = [ChoiceText(tok, views[i // n], want_lp) for i in range(len(streams))]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            every = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            frames = completion_frames(
                ctx, rid, created, streams, len(prompts), include_usage, texts,
                usage_every_chunk=every, drop_output=max_tokens == 0,
            )  # fmt: skip
            return EventStreamResponse(frames, lambda: close_all(streams))
        try:
            results = await _finish(request, streams)
        except Exception as exc:
            return openai_error_response(exc)
        if results is None:
            return Response(status_code=CLIENT_CLOSED)
        choices = []
        for i, r in enumerate(results):
            text, logprobs, scores = texts[i].next(r.text, r.logprobs, r.prompt_logprobs)
            reason = "length" if max_tokens == 0 else finish_reason(r.finish_reason)
            choices.append(CompletionChoice(i, text, reason, logprobs, scores))
        usages = [no_output(r.usage) if max_tokens == 0 else r.usage for r in results]
        usage = usage_out(total_usage(usages, len(prompts)))
        answer = Completion(
            rid, created, ctx.model_name, choices, usage,
            system_fingerprint=ctx.engine.system_fingerprint,
        )  # fmt: skip
        if transfer is not None and transfer.do_remote_decode:
            answer.kv_transfer_params = kept_for_consumer(ctx, rid)
        return json_response(answer)

    return completions


def _prompt_views(
    ctx: ApiContext,
    req: CompletionRequest,
    items: list[str | list[int]],
    prompts: list[list[int]],
    max_tokens: int,
) -> list[PromptView]:
    """What each prompt's choices show of it; `max_tokens: 0` only with `echo` (the prompt's
    scores alone, as lm-evaluation-harness asks for them)."""
    if max_tokens == 0 and not req.echo:
        raise invalid("max_tokens", "must be at least 1 (0 only with echo: true)")
    tok = ctx.engine.tokenizer
    return [
        PromptView(
            text=item if isinstance(item, str) else tok.decode(ids),
            ids=ids,
            echo=bool(req.echo),
            num_top=req.logprobs if req.echo else None,
            num_prompt_top=req.prompt_logprobs,
            drop_output=max_tokens == 0,
        )
        for item, ids in zip(items, prompts, strict=True)
    ]


def _num_prompt_scores(req: CompletionRequest) -> int | None:
    """Alternatives to score per prompt token: the most `echo` with `logprobs` and
    `prompt_logprobs` ask for (None: no prompt scores)."""
    asked = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    return max(asked) if asked else None
