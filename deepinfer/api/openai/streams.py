"""OpenAI streaming bodies: chat.completion.chunk and text_completion frames, then [DONE]."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import msgspec

from deepinfer.api.context import ApiContext
from deepinfer.api.http.errors import openai_payload, to_api_error
from deepinfer.api.http.sse import DONE_FRAME, data_frame
from deepinfer.api.openai.convert import (
    chat_logprobs,
    finish_reason,
    no_output,
    usage_out,
)
from deepinfer.api.openai.prompt_logprobs import ChoiceText
from deepinfer.api.openai.schemas import (
    ChatCompletionChunk,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    Completion,
    CompletionChoice,
)
from deepinfer.api.openai.tools import CALL_ID_PREFIX, event_deltas
from deepinfer.api.protocol import OutputStream
from deepinfer.api.reasoning import NO_REASONING, ReasoningPlan
from deepinfer.api.streams import merge, total_usage
from deepinfer.api.tools.plan import NO_TOOLS, ToolPlan, ToolStream, called
from deepinfer.engine.types import GenerationOutput, Usage


async def chat_frames(
    ctx: ApiContext,
    rid: str,
    created: int,
    streams: Sequence[OutputStream],
    include_usage: bool,
    want_logprobs: bool,
    *,
    usage_every_chunk: bool = False,
    plan: ToolPlan = NO_TOOLS,
    reasoning: ReasoningPlan = NO_REASONING,
) -> AsyncIterator[bytes]:
    """`usage_every_chunk` (vLLM's `continuous_usage_stats`): each chunk carries the usage so far.
    A reasoning model's think block streams as `delta.reasoning_content` chunks ahead of the
    content. With tools (`plan`), each choice's content goes through a `ToolStream`: content
    and call deltas come in the order written."""
    model, tok, fp = ctx.model_name, ctx.engine.tokenizer, ctx.engine.system_fingerprint
    usages: list[Usage] = [Usage(s.num_prompt_tokens, 0, 0) for s in streams]
    tools = [ToolStream(plan, CALL_ID_PREFIX) for _ in streams] if plan.parses_calls else None
    splitters = [reasoning.splitter(tok) for _ in streams]

    def chunk(choices: list[ChunkChoice]) -> bytes:
        usage = usage_out(total_usage(usages, 1)) if usage_every_chunk else None
        return data_frame(
            ChatCompletionChunk(rid, created, model, choices, usage, system_fingerprint=fp)
        )

    yield chunk(
        [ChunkChoice(i, ChunkDelta(role="assistant", content="")) for i in range(len(streams))]
    )
    try:
        async for i, out in merge(streams):
            usages[i] = out.usage
            lp = chat_logprobs(tok, out.logprobs) if want_logprobs else None
            text, splitter = out.text, splitters[i]
            if splitter is not None:
                thought, text = splitter.feed_parts(out.text, out.token_ids)
                if thought:
                    yield chunk([ChunkChoice(i, ChunkDelta(reasoning_content=thought))])
            if tools is not None:
                for choice in _tool_chunks(i, tools[i], out, lp, text):
                    yield chunk([choice])
            elif text or lp is not None or out.finished:
                delta = ChunkDelta(content=text or None)
                yield chunk([ChunkChoice(i, delta, lp, finish_reason(out.finish_reason))])
    except Exception as exc:
        yield data_frame(openai_payload(to_api_error(exc)))
        yield DONE_FRAME
        return
    if include_usage:
        usage = usage_out(total_usage(usages, 1))
        yield data_frame(ChatCompletionChunk(rid, created, model, [], usage, system_fingerprint=fp))
    yield DONE_FRAME


def _tool_chunks(
    index: int, stream: ToolStream, out: GenerationOutput, lp: ChoiceLogprobs | None, text: str
) -> list[ChunkChoice]:
    """Choice `index`'s chunks for one output (`text`: its content): its parsed deltas (the
    logprobs on the first), the finish reason on the last (`tool_calls` after a call)."""
    deltas = event_deltas(stream.feed(text, out.finished), stream)
    if not deltas and (out.finished or lp is not None):
        deltas.append(ChunkDelta())
    choices = [ChunkChoice(index, d) for d in deltas]
    if choices:
        choices[0].logprobs = lp
    if out.finished:
        called_tools = called(out.finish_reason, stream.num_calls)
        reason = finish_reason(out.finish_reason)
        choices[-1].finish_reason = "tool_calls" if called_tools else reason
    return choices


async def completion_frames(
    ctx: ApiContext,
    rid: str,
    created: int,
    streams: Sequence[OutputStream],
    num_prompts: int,
    include_usage: bool,
    texts: Sequence[ChoiceText],
    *,
    usage_every_chunk: bool = False,
    drop_output: bool = False,
) -> AsyncIterator[bytes]:
    """`texts[i]` makes choice i's text and logprobs (the echoed prompt first);
    `usage_every_chunk` (vLLM's `continuous_usage_stats`): each chunk carries the usage so far;
    `drop_output` (`max_tokens: 0`): the prompt's part alone, finished by `length`."""
    model, fp = ctx.model_name, ctx.engine.system_fingerprint
    usages: list[Usage] = [Usage(s.num_prompt_tokens, 0, 0) for s in streams]
    try:
        async for i, out in merge(streams):
            usages[i] = no_output(out.usage) if drop_output else out.usage
            text, lp, scores = texts[i].next(out.text, out.logprobs, out.prompt_logprobs)
            reason = finish_reason(out.finish_reason)
            if drop_output and reason is not None:
                reason = "length"
            if text or lp is not None or out.finished or scores is not msgspec.UNSET:
                choice = CompletionChoice(i, text, reason, lp, scores)
                so_far = usage_out(total_usage(usages, num_prompts)) if usage_every_chunk else None
                yield data_frame(
                    Completion(rid, created, model, [choice], so_far, system_fingerprint=fp)
                )
    except Exception as exc:
        yield data_frame(openai_payload(to_api_error(exc)))
        yield DONE_FRAME
        return
    if include_usage:
        usage = usage_out(total_usage(usages, num_prompts))
        yield data_frame(Completion(rid, created, model, [], usage, system_fingerprint=fp))
    yield DONE_FRAME
