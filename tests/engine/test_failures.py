"""Failure isolation on a tiny random Llama: a step that raises fails the requests of that step
only (their streams raise `RequestFailedError`, their blocks are freed) and the engine serves on
with the same greedy tokens as a fresh engine; a delta that cannot be delivered fails its own
request only; an error the engine cannot recover from stops it, with a reason."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from deepinfer.api.app import create_app
from deepinfer.config import WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.stream import RequestStream
from deepinfer.engine.workers import Worker
from deepinfer.errors import EngineDeadError, FatalEngineError, RequestFailedError
from deepinfer.outputs import RunnerOutput, TokenDelta
from deepinfer.scheduler.output import ScheduleOutput, StepKind
from tests.engine.tiny_engine import GREEDY, run_all, settle, tiny_config, token_prompts

MODES = {
    "colocated": WorkersConfig(colocated=True),
    "disagg": WorkersConfig(prefill_step_ms=5.0, prefill_buckets=(16, 48)),
    "split": WorkersConfig(
        prefill_devices=("cpu:0",),
        decode_devices=("cpu:1",),
        prefill_step_ms=5.0,
        prefill_buckets=(16, 48),
    ),
}


async def _outcome(engine: AsyncEngine, ids: list[int]) -> list[int] | BaseException:
    out: list[int] = []
    try:
        async for delta in engine.generate(ids, GREEDY):
            out.extend(delta.token_ids)
    except RequestFailedError as exc:
        return exc
    return out


def _poison(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch, poisons: list[tuple[list[int], int]]
) -> set[str]:
    """Make every step raise on the worker's thread that holds a request with a poisoned
    (prompt, number of output tokens); returns the ids of the requests of the steps that
    raised."""
    failed: set[str] = set()
    core = engine.core
    for runner in {id(r): r for r in (core.runner, core.decode_runner)}.values():
        execute: Callable[[ScheduleOutput], RunnerOutput] = runner.execute

        def raising(so: ScheduleOutput, execute: Callable[..., RunnerOutput] = execute) -> object:
            held = {(tuple(c.request.prompt_token_ids), c.request.num_tokens) for c in so.chunks}
            if any((tuple(p), len(p) + n) in held for p, n in poisons):
                failed.update(c.request_id for c in so.chunks)
                raise RuntimeError("injected fault")
            return execute(so)

        monkeypatch.setattr(runner, "execute", raising)
    return failed


PROMPTS = token_prompts()[:6]
_REFERENCE: list[list[int]] = []


async def _reference(model_dir: Path) -> list[list[int]]:
    """Greedy tokens of `PROMPTS` on a fresh engine (the same in every mode)."""
    if not _REFERENCE:
        async with AsyncEngine(tiny_config(model_dir, MODES["colocated"])) as engine:
            _REFERENCE.extend(await run_all(engine, PROMPTS))
    return _REFERENCE


@pytest.mark.parametrize("mode", list(MODES))
async def test_failed_step_fails_only_its_requests(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """One request fails in its prefill, another at its fourth token (in decode)."""
    reference = await _reference(tiny_llama_dir)
    async with AsyncEngine(tiny_config(tiny_llama_dir, MODES[mode])) as engine:
        failed = _poison(engine, monkeypatch, [(PROMPTS[1], 0), (PROMPTS[4], 3)])
        outcomes = await asyncio.gather(*(_outcome(engine, p) for p in PROMPTS))
        assert isinstance(outcomes[1], RequestFailedError)
        assert isinstance(outcomes[4], RequestFailedError)
        assert "RuntimeError" in str(outcomes[1])
        num_failed = sum(isinstance(o, RequestFailedError) for o in outcomes)
        assert 2 <= num_failed <= len(failed)
        for got, want in zip(outcomes, reference, strict=True):
            assert isinstance(got, RequestFailedError) or got == want
        await settle(engine)
        engine.check_integrity()
        stats = engine.stats()
        assert stats.num_blocks_used == 0 and stats.decode_blocks_used == 0
        assert stats.num_failed_requests == num_failed and stats.num_failed_steps >= 2
        assert engine.is_running and engine.dead_reason is None
        monkeypatch.undo()
        assert await run_all(engine, PROMPTS) == reference


async def test_failed_delivery_fails_only_its_request(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    push = RequestStream.push

    def flaky(self: RequestStream, delta: TokenDelta, *, wake: bool = True) -> bool:
        if self.request_id == "victim" and delta.num_output_tokens == 2:
            raise UnicodeError("injected fault")
        return push(self, delta, wake=wake)

    prompts = PROMPTS
    reference = await _reference(tiny_llama_dir)
    async with AsyncEngine(tiny_config(tiny_llama_dir, MODES["disagg"])) as engine:
        monkeypatch.setattr(RequestStream, "push", flaky)

        async def victim() -> None:
            async for _ in engine.generate(prompts[0], GREEDY, request_id="victim"):
                pass

        with pytest.raises(RequestFailedError, match="UnicodeError"):
            await asyncio.gather(victim(), run_all(engine, prompts))
        await settle(engine)
        assert await run_all(engine, prompts) == reference
        engine.check_integrity()
        assert engine.stats().num_blocks_used == 0 and engine.stats().num_failed_requests == 1


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
async def test_inconsistent_scheduler_after_a_failed_step_stops_the_engine(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    prompts = PROMPTS[:3]
    async with AsyncEngine(tiny_config(tiny_llama_dir, MODES[mode])) as engine:
        _poison(engine, monkeypatch, [(prompts[0], 0)])

        def broken() -> None:
            raise AssertionError("queues and the request table disagree")

        monkeypatch.setattr(engine.core, "check_integrity", broken)
        outcomes = await asyncio.gather(
            *(_outcome(engine, p) for p in prompts), return_exceptions=True
        )
        assert all(isinstance(o, EngineDeadError | RequestFailedError) for o in outcomes)
        assert any(isinstance(o, EngineDeadError) for o in outcomes)
        assert not engine.is_running
        reason = engine.dead_reason
        assert reason is not None and "inconsistent" in reason and "disagree" in reason
        with pytest.raises(EngineDeadError, match="inconsistent"):
            await engine.submit(prompts[0], GREEDY)
        app = create_app(engine)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as client:
            health = await client.get("/health")
        assert health.status_code == 503
        assert health.json() == {"status": "unavailable", "reason": reason}


class _Stream:
    """Stands in for a CUDA stream: counts synchronizes, or fails them (a lost device)."""

    def __init__(self, lost: bool) -> None:
        self.lost = lost
        self.num_syncs = 0

    def synchronize(self) -> None:
        self.num_syncs += 1
        if self.lost:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def _failing_worker(stream: _Stream) -> Worker:
    def execute(so: ScheduleOutput) -> RunnerOutput:
        raise ValueError("injected fault")

    lane: Any = SimpleNamespace(kind=StepKind.MIXED)
    worker = Worker(lane, torch.device("cpu"), None, execute)
    worker._stream = stream  # type: ignore[assignment]
    return worker


def test_failed_step_on_a_stream_waits_for_it_before_raising() -> None:
    stream = _Stream(lost=False)
    worker = _failing_worker(stream)
    so = ScheduleOutput(step=1, chunks=())
    with pytest.raises(ValueError, match="injected"):
        worker._run(so, None)
    assert stream.num_syncs == 1, "the failed step's kernels were not waited for"
    worker.shutdown()


async def test_lost_device_stops_the_engine_with_a_reason(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = _failing_worker(_Stream(lost=True))
    with pytest.raises(FatalEngineError, match="is lost: CUDA error"):
        worker._run(ScheduleOutput(step=1, chunks=()), None)
    worker.shutdown()
    async with AsyncEngine(tiny_config(tiny_llama_dir, MODES["colocated"])) as engine:
        (mixed,) = engine._workers
        mixed._stream = _Stream(lost=True)  # type: ignore[assignment]
        _poison(engine, monkeypatch, [(PROMPTS[0], 0)])
        with pytest.raises(EngineDeadError):
            await _outcome(engine, PROMPTS[0])
        assert not engine.is_running
        assert engine.dead_reason is not None and "is lost" in engine.dead_reason
