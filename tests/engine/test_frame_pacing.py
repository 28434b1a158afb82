"""Readers woken once for several tokens when many streams share quick steps (`FramePacer`):
only how a stream is cut into frames changes. The same requests, paced and unpaced, give the same
text, token ids, usage, finish and stop reasons; stop strings cut at the same character; an abort
frees its blocks; the first token is never held back, and a held token is woken by the timer."""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.api.app import create_app
from deepinfer.config import CacheConfig, Config, DiskCacheConfig, ModelConfig, SchedulerConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.frame_pacer import FramePacer
from deepinfer.engine.stream import RequestStream
from deepinfer.engine.stream_table import StreamTable
from deepinfer.environment import default_model_path
from deepinfer.model.loading.gguf_loader import open_gguf
from deepinfer.outputs import TokenDelta
from deepinfer.request import FinishReason, SamplingParams
from deepinfer.text.detokenizer import IncrementalDetokenizer
from deepinfer.text.tokenizer import Tokenizer
from tests.api.live_server import LiveServer


def test_pacer_wakes_every_token_for_few_streams_or_slow_steps() -> None:
    pacer = FramePacer(frames_per_step=4, max_delay_s=0.05)
    assert pacer.tokens_per_frame(4, now=0.0) == 1  # few streams
    assert pacer.tokens_per_frame(9, now=0.01) == 3  # ceil(9 / 4), a quick step
    assert pacer.tokens_per_frame(16, now=0.02) == 4
    assert pacer.tokens_per_frame(16, now=0.10) == 1  # 80 ms since the last step: slow steps
    assert FramePacer(frames_per_step=0).tokens_per_frame(1000, now=0.0) == 1  # off
    lanes = FramePacer(frames_per_step=4, max_delay_s=0.05)
    assert lanes.tokens_per_frame(16, now=0.0, lane="decode") == 1
    assert lanes.tokens_per_frame(2, now=0.09, lane="prefill") == 1
    assert lanes.tokens_per_frame(16, now=0.10, lane="decode") == 1  # decode's steps are slow
    assert lanes.tokens_per_frame(16, now=0.11, lane="decode") == 4


def _config(frames_per_step: int) -> Config:
    return Config(
        model=ModelConfig(path=Path("null")),
        cache=CacheConfig(kv_memory_bytes=64 << 20),
        disk_cache=DiskCacheConfig(enabled=False),
        scheduler=SchedulerConfig(stream_frames_per_step=frames_per_step, stream_max_delay_ms=500),
    )


@dataclasses.dataclass
class Answer:
    frames: list[int]  # tokens per frame
    text: str
    token_ids: tuple[int, ...]
    finish: FinishReason | None
    stop_reason: str | int | None
    usage: object


async def _answer(engine: AsyncEngine, prompt: str, params: SamplingParams) -> Answer:
    frames: list[int] = []
    parts: list[str] = []
    ids: list[int] = []
    last = None
    async for out in engine.generate(prompt, params):
        frames.append(len(out.token_ids))
        parts.append(out.text)
        ids.extend(out.token_ids)
        last = out
    assert last is not None
    return Answer(
        frames, "".join(parts), tuple(ids), last.finish_reason, last.stop_reason, last.usage
    )


async def _aborted(engine: AsyncEngine, prompt: str) -> int:
    """Read three frames of a long answer, then abort it; returns the tokens read."""
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    stream = await engine.submit(prompt, params)
    seen = 0
    for _ in range(3):
        seen += len((await anext(stream)).token_ids)
    await stream.aclose()
    return seen


async def _run(frames_per_step: int, stops: dict[int, str]) -> tuple[list[Answer], int, int]:
    """16 concurrent requests (lengths 20-60, some with stop strings) and one aborted one."""
    async with AsyncEngine(_config(frames_per_step)) as engine:
        requests = [engine_prompt(i) for i in range(16)]
        params = [
            SamplingParams(
                max_tokens=20 + 3 * i,
                temperature=0.0,
                ignore_eos=True,
                stop=(stops[i],) if i in stops else (),
            )
            for i in range(16)
        ]
        answers, aborted = await asyncio.gather(
            asyncio.gather(*(_answer(engine, p, s) for p, s in zip(requests, params, strict=True))),
            _aborted(engine, "Keep talking, at length, about anything at all."),
        )
        for _ in range(100):  # the abort is applied at the next step boundary
            if engine.core.kv.num_used_blocks == 0:
                break
            await asyncio.sleep(0.01)
        used = engine.core.kv.num_used_blocks
        engine.check_integrity()
    return list(answers), aborted, used


def engine_prompt(i: int) -> str:
    return f"Story {i}: tell me about the number {i} and its friends. " * (1 + i % 3)


@pytest.mark.slow
async def test_paced_frames_carry_the_same_answers() -> None:
    unpaced, _, _ = await _run(0, {})
    # stop strings from the answers themselves: a word in the middle of answers 3, 7 and 11
    stops = {i: unpaced[i].text.split()[len(unpaced[i].text.split()) // 2] for i in (3, 7, 11)}
    unpaced, _, _ = await _run(0, stops)
    paced, aborted, used = await _run(2, stops)
    assert aborted >= 3 and used == 0  # the aborted request's blocks are free
    for i, (want, got) in enumerate(zip(unpaced, paced, strict=True)):
        assert got.text == want.text and got.token_ids == want.token_ids, i
        assert (got.finish, got.stop_reason, got.usage) == (
            want.finish,
            want.stop_reason,
            want.usage,
        )
        assert got.frames[0] == 1  # the first token is never held back
        assert sum(got.frames) == len(got.token_ids)
    for i, stop in stops.items():
        assert paced[i].finish is FinishReason.STOP and paced[i].stop_reason == stop
        assert stop not in paced[i].text  # cut before the stop, as unpaced
    assert all(max(a.frames) == 1 for a in unpaced)  # unpaced: one token a frame
    assert max(max(a.frames) for a in paced) > 1  # paced: 17 streams over 2 frames a step merge
    assert sum(len(a.frames) for a in paced) < sum(len(a.frames) for a in unpaced)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(default_model_path()))


def _delta(rid: str, token: int, n: int) -> TokenDelta:
    return TokenDelta(rid, (token,), num_prompt_tokens=3, num_output_tokens=n)


async def test_a_held_token_is_woken_by_the_timer(tokenizer: Tokenizer) -> None:
    hello = tokenizer.encode(" hello")[0]
    table = StreamTable(FramePacer(frames_per_step=1, max_delay_s=0.05))
    streams = [
        RequestStream(rid, 3, IncrementalDetokenizer(tokenizer), (), frozenset(), lambda _r: None)
        for rid in ("a", "b")
    ]
    for s in streams:
        table.open(s)
    table.deliver([_delta("a", hello, 1), _delta("b", hello, 1)])  # first tokens: woken
    assert [(await anext(s)).text for s in streams] == [" hello", " hello"]
    readers = [asyncio.ensure_future(anext(s)) for s in streams]
    await asyncio.sleep(0)  # both readers wait
    loop = asyncio.get_running_loop()
    start = loop.time()
    table.deliver([_delta("a", hello, 2), _delta("b", hello, 2)])  # a quick step: 2 a frame
    assert all(s.num_unread_tokens == 1 for s in streams)
    await asyncio.sleep(0.01)
    assert not any(r.done() for r in readers)  # held
    outs = await asyncio.wait_for(asyncio.gather(*readers), timeout=2)
    assert [o.text for o in outs] == [" hello", " hello"]
    assert loop.time() - start >= 0.04  # woken by the timer


@pytest.mark.slow
def test_paced_sse_streams_through_the_openai_client() -> None:
    """Eight concurrent streams (200 tokens each, so they overlap) over a budget of one frame a
    step: the official client reads multi-token chunks whose content and usage equal the
    non-streamed answers."""
    openai = pytest.importorskip("openai")
    config = _config(1)
    server = LiveServer(create_app(AsyncEngine(config), config.server)).start(timeout_s=120)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")

        def ask(i: int, stream: bool) -> tuple[str, int, int]:
            kwargs = {"model": "null", "max_tokens": 200 + i, "temperature": 0, "seed": i}
            messages = [{"role": "user", "content": engine_prompt(i)}]
            if not stream:
                whole = client.chat.completions.create(messages=messages, **kwargs)
                usage = whole.usage
                return whole.choices[0].message.content or "", usage.completion_tokens, 1
            chunks = list(
                client.chat.completions.create(
                    messages=messages, stream=True, stream_options={"include_usage": True},
                    **kwargs,
                )
            )  # fmt: skip
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return text, chunks[-1].usage.completion_tokens, len(chunks)

        with ThreadPoolExecutor(8) as pool:
            streamed = list(pool.map(lambda i: ask(i, True), range(8)))
        whole = [ask(i, False) for i in range(8)]
    finally:
        server.stop()
    assert [s[:2] for s in streamed] == [w[:2] for w in whole]
    assert all(tokens == 200 + i for i, (_, tokens, _) in enumerate(streamed))
    # fewer chunks than tokens: several tokens a chunk (role chunk, usage chunk and finish aside)
    assert sum(s[2] for s in streamed) < sum(s[1] for s in streamed)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_pacing_loses_nothing(tokenizer: Tokenizer, data: st.DataObject) -> None:
    """Random steps over random streams (finishing at different steps, some stopping on a
    string, cut characters included), under any frame budget, with readers that read whenever
    they are woken: every reader gets exactly the text, ids and finish it gets unpaced."""
    vocab = [tokenizer.encode(w)[0] for w in (" red", " green", " blue", " STOP", " é", "🤗")]
    budget = data.draw(st.integers(0, 4), label="frames_per_step")
    num = data.draw(st.integers(1, 8), label="streams")
    plans = [
        data.draw(st.lists(st.sampled_from(vocab), min_size=1, max_size=12), label=f"tokens {i}")
        for i in range(num)
    ]
    asyncio.run(_paced_vs_unpaced(tokenizer, plans, budget))


async def _paced_vs_unpaced(tokenizer: Tokenizer, plans: list[list[int]], budget: int) -> None:
    results = []
    for pacer in (FramePacer(0, 0.02), FramePacer(budget, 0.02)):
        table = StreamTable(pacer)
        streams = [
            RequestStream(
                f"r{i}",
                3,
                IncrementalDetokenizer(tokenizer),
                (" STOP",),
                frozenset(),
                lambda _r: None,
            )
            for i in range(len(plans))
        ]
        for s in streams:
            table.open(s)
        readers = [asyncio.ensure_future(_read_all(s)) for s in streams]
        for step in range(max(map(len, plans))):
            deltas = [
                TokenDelta(
                    f"r{i}",
                    (plan[step],),
                    finish_reason=FinishReason.LENGTH if step == len(plan) - 1 else None,
                    num_prompt_tokens=3,
                    num_output_tokens=step + 1,
                )
                for i, plan in enumerate(plans)
                if step < len(plan)
            ]
            table.deliver(deltas, "decode")
            table.apply_aborts(lambda _rid: None)
            await asyncio.sleep(0)  # readers run between steps, as on the loop
        results.append(await asyncio.wait_for(asyncio.gather(*readers), timeout=5))
    unpaced, paced = results
    assert paced == unpaced


async def _read_all(stream: RequestStream) -> tuple[str, tuple[int, ...], object, object]:
    text, ids, last = "", (), None
    async for out in stream:
        text += out.text
        ids += out.token_ids
        last = out
    assert last is not None
    return text, ids, last.finish_reason, last.stop_reason
