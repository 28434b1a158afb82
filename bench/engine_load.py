"""Load on an engine through the embedding API: `closed_loop`, N streams kept busy for a while."""

from __future__ import annotations

import asyncio
import contextlib
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
    empty until the slowest one ends."""
    start = time.perf_counter()
    deadline = start + (seconds if seconds is not None else window_seconds(streams))
    streamed = 0

    def prompt(k: int) -> Prompt:
        return prompts(k) if callable(prompts) else prompts[k % len(prompts)]

    async def client(i: int) -> None:
        nonlocal streamed
        for k in itertools.count(i, streams):
            async with contextlib.aclosing(engine.generate(prompt(k), params)) as it:
                async for out in it:
                    if time.perf_counter() >= deadline:
                        return
                    streamed += len(out.token_ids)

    await asyncio.gather(*(client(i) for i in range(streams)))
    return streamed / (deadline - start)
