"""Reading engine output streams: merging several (n > 1, batched prompts) and collecting one
into a finished result for non-streaming responses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from deepinfer.api.protocol import OutputStream
from deepinfer.engine.types import GenerationOutput, Usage
from deepinfer.outputs import PromptLogprob, SampledToken
from deepinfer.request import FinishReason


@dataclass(frozen=True)
class Collected:
    """All of one request's output, for a non-streaming answer."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[SampledToken, ...]
    finish_reason: FinishReason
    stop_reason: str | int | None
    usage: Usage
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None
    """The prompt's scores, when the request asked for them."""


async def collect(stream: OutputStream) -> Collected:
    """Read a stream to its end; the stream is closed (request aborted) if this is cancelled."""
    texts: list[str] = []
    token_ids: list[int] = []
    logprobs: list[SampledToken] = []
    last: GenerationOutput | None = None
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None
    try:
        async for out in stream:
            texts.append(out.text)
            token_ids.extend(out.token_ids)
            logprobs.extend(out.logprobs)
            if out.prompt_logprobs is not None:
                prompt_logprobs = out.prompt_logprobs
            last = out
    finally:
        await stream.aclose()
    assert last is not None and last.finish_reason is not None, "stream ended without finishing"
    return Collected(
        "".join(texts),
        tuple(token_ids),
        tuple(logprobs),
        last.finish_reason,
        last.stop_reason,
        last.usage,
        prompt_logprobs,
    )


async def collect_all(streams: Sequence[OutputStream]) -> list[Collected]:
    return list(await asyncio.gather(*(collect(s) for s in streams)))


async def merge(streams: Sequence[OutputStream]) -> AsyncIterator[tuple[int, GenerationOutput]]:
    """(index, output) pairs from several streams as they arrive.

    At most one read is pending per stream, so a slow reader leaves deltas to merge in the
    engine's mailbox rather than piling them up here.
    """
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    iterators = [s.__aiter__() for s in streams]
    pending: dict[asyncio.Future[GenerationOutput], int] = {
        asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    out = fut.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
    finally:
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def close_all(streams: Sequence[OutputStream]) -> None:
    """Abort every unfinished request (idempotent)."""
    for s in streams:
        await s.aclose()


def total_usage(collected: Sequence[Usage], num_prompts: int) -> Usage:
    """Usage of a request that sampled `len(collected)` choices from `num_prompts` prompts: each
    prompt is counted once (choice i belongs to prompt i // n), completions summed."""
    n = len(collected) // num_prompts
    firsts = collected[::n]
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in firsts),
        completion_tokens=sum(u.completion_tokens for u in collected),
        cached_tokens=sum(u.cached_tokens for u in firsts),
        disk_cached_tokens=sum(u.disk_cached_tokens for u in firsts),
        host_cached_tokens=sum(u.host_cached_tokens for u in firsts),
        remote_cached_tokens=sum(u.remote_cached_tokens for u in firsts),
        accepted_prediction_tokens=sum(u.accepted_prediction_tokens for u in collected),
        rejected_prediction_tokens=sum(u.rejected_prediction_tokens for u in collected),
    )
