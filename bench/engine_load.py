"""Load on an engine through the embedding API: `closed_loop`, N streams kept busy for a while."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence

from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.prompts import Prompt
from deepinfer.request import SamplingParams


def window_seconds(streams: int) -> float:
    """How long a measurement with `streams` lasts: long enough for every stream to finish a
    request or more (a 128-token request takes about 7 s among 32 on two cores)."""
    return max(5.0, 0.3 * streams)


async def closed_loop(
    engine: AsyncEngine,
    prompts: Sequence[Prompt] | Callable[[int], Prompt],
    params: SamplingParams,
    streams: int,
    seconds: float | None = None,
) -> float:
    """`streams` clients, each sending a request as soon as its last one ended (client i sends
    prompts i, i + streams, i + 2 * streams... in turn, or `prompts(k)` for its k-th), for `seconds`
    (`window_seconds` by default): the tokens streamed in that window, per second. Requests
    still running at its end are aborted. The batch stays full, as in serving: with one batch of
    requests that all start together, a request that finished early would leave its slot
    empty until the slowest one ends. Nor do the streams move in step: client i's first request
    stops after (i + 1) / streams of `params.max_tokens`, so that from the start requests end
    and begin at every step, as users' do (requests that all start and end together would make
    the batch a wave, whose phase at the window's end decides much of the tokens counted, and
    whose waves a method that speeds some requests up and not others breaks up: measured on
    speculative decoding, a wave's step times swing by a third from its first step to its
    last)."""
    start = time.perf_counter()
    deadline = start + (seconds if seconds is not None else window_seconds(streams))
    streamed = 0

    def prompt(k: int) -> Prompt:
        return prompts(k) if callable(prompts) else prompts[k % len(prompts)]

    def stagger(i: int) -> SamplingParams:
        first = max(1, -(-params.max_tokens * (i + 1) // streams))
        return dataclasses.replace(params, max_tokens=first)

    async def client(i: int) -> None:
        nonlocal streamed
        for k in itertools.count(i, streams):
            sampling = stagger(i) if k == i else params
            async with contextlib.aclosing(engine.generate(prompt(k), sampling)) as it:
                async for out in it:
                    if time.perf_counter() >= deadline:
                        return
                    streamed += len(out.token_ids)

    await asyncio.gather(*(client(i) for i in range(streams)))
    return streamed / (deadline - start)
