"""OpenAI streaming bodies: chat.completion.chunk and text_completion frames, then [DONE]."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from deepinfer.api.context import ApiContext
from deepinfer.api.errors import openai_payload, to_api_error
from deepinfer.api.openai_convert import (
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    usage_out,
)
from deepinfer.api.openai_schemas import (
    ChatCompletionChunk,
    ChunkChoice,
    ChunkDelta,
    Completion,
    CompletionChoice,
)
from deepinfer.api.protocol import OutputStream
from deepinfer.api.sse import DONE_FRAME, data_frame
from deepinfer.api.streams import merge, total_usage
from deepinfer.engine.types import Usage


async def chat_frames(
    ctx: ApiContext,
    rid: str,
    created: int,
    streams: Sequence[OutputStream],
    include_usage: bool,
    want_logprobs: bool,
) -> AsyncIterator[bytes]:
    model, tok = ctx.model_name, ctx.engine.tokenizer

    def chunk(choices: list[ChunkChoice]) -> bytes:
        return data_frame(ChatCompletionChunk(rid, created, model, choices))

    yield chunk(
        [ChunkChoice(i, ChunkDelta(role="assistant", content="")) for i in range(len(streams))]
    )
    usages: list[Usage] = [Usage(s.num_prompt_tokens, 0, 0) for s in streams]
    try:
        async for i, out in merge(streams):
            usages[i] = out.usage
            lp = chat_logprobs(tok, out.logprobs) if want_logprobs else None
            if out.text or lp is not None or out.finished:
                delta = ChunkDelta(content=out.text or None)
                yield chunk([ChunkChoice(i, delta, lp, finish_reason(out.finish_reason))])
    except Exception as exc:
        yield data_frame(openai_payload(to_api_error(exc)))
        yield DONE_FRAME
        return
    if include_usage:
        usage = usage_out(total_usage(usages, 1))
        yield data_frame(ChatCompletionChunk(rid, created, model, [], usage))
    yield DONE_FRAME


async def completion_frames(
    ctx: ApiContext,
    rid: str,
    created: int,
    streams: Sequence[OutputStream],
    num_prompts: int,
    include_usage: bool,
    want_logprobs: bool,
) -> AsyncIterator[bytes]:
    model, tok = ctx.model_name, ctx.engine.tokenizer
    usages: list[Usage] = [Usage(s.num_prompt_tokens, 0, 0) for s in streams]
    offsets = [0] * len(streams)
    try:
        async for i, out in merge(streams):
            usages[i] = out.usage
            lp = completion_logprobs(tok, out.logprobs, offsets[i]) if want_logprobs else None
            offsets[i] += len(out.text)
            if out.text or lp is not None or out.finished:
                choice = CompletionChoice(i, out.text, finish_reason(out.finish_reason), lp)
                yield data_frame(Completion(rid, created, model, [choice]))
    except Exception as exc:
        yield data_frame(openai_payload(to_api_error(exc)))
        yield DONE_FRAME
        return
    if include_usage:
        usage = usage_out(total_usage(usages, num_prompts))
        yield data_frame(Completion(rid, created, model, [], usage))
    yield DONE_FRAME
