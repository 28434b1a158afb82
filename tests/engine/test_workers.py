"""Workers on a tiny random Llama: the disaggregated engine (prefill and decode workers whose
steps overlap) gives exactly the colocated engine's greedy tokens, survives aborts in flight
without leaking a block, and reports its workers and planner; plus the pure pieces of workers.py.
"""

from __future__ import annotations

import asyncio
import gc
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from deepinfer.config import WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.workers import BusyMeter, ThreadLending, Worker, thread_shares
from deepinfer.errors import ConfigError
from deepinfer.outputs import RunnerOutput
from deepinfer.request import SamplingParams
from deepinfer.scheduler.output import ScheduleOutput, StepKind
from tests.engine.tiny_engine import (
    GREEDY,
    leave_after,
    run_all,
    settle,
    tiny_config,
    token_prompts,
)


@pytest.mark.slow
async def test_disaggregated_matches_colocated(tiny_llama_dir: Path) -> None:
    prompts = token_prompts()
    results = {}
    for name, workers in (
        ("colocated", WorkersConfig(colocated=True)),
        ("disagg", WorkersConfig(prefill_step_ms=5.0, prefill_buckets=(16, 48))),
    ):
        async with AsyncEngine(tiny_config(tiny_llama_dir, workers)) as engine:
            results[name] = await run_all(engine, prompts)
            stats = engine.stats()
            engine.check_integrity()
            assert stats.num_blocks_used == 0
            names = [w.name for w in stats.workers]
            if name == "disagg":
                assert names == ["prefill", "decode"]
                assert stats.prefill is not None and stats.prefill.num_steps_observed > 0
                assert all(w.num_steps > 0 for w in stats.workers)
            else:
                assert names == ["mixed"] and stats.prefill is None
    assert results["disagg"] == results["colocated"]
    assert all(len(r) == GREEDY.max_tokens for r in results["disagg"])


async def test_aborts_in_flight_free_every_block(tiny_llama_dir: Path) -> None:
    workers = WorkersConfig(prefill_step_ms=2.0, prefill_buckets=(16, 48))
    async with AsyncEngine(tiny_config(tiny_llama_dir, workers)) as engine:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        counts = await asyncio.gather(
            *(leave_after(engine, p, params, 1 + i % 5) for i, p in enumerate(token_prompts()))
        )
        assert all(c >= 1 for c in counts)
        await settle(engine)
        engine.check_integrity()
        assert engine.stats().num_blocks_used == 0
        # and it still serves
        (again,) = await run_all(engine, token_prompts()[:1])
        assert len(again) == GREEDY.max_tokens


def test_thread_shares() -> None:
    assert thread_shares(WorkersConfig(), 2) == (1, 1)
    assert thread_shares(WorkersConfig(), 8) == (4, 4)
    assert thread_shares(WorkersConfig(), 1) == (1, 1)
    assert thread_shares(WorkersConfig(prefill_threads=3), 8) == (3, 5)
    assert thread_shares(WorkersConfig(decode_threads=6), 8) == (4, 6)


def _cpu_worker(kind: StepKind, has_work: bool, num_threads: int, seen: list[Any]) -> Worker:
    def execute(so: ScheduleOutput) -> RunnerOutput:
        seen.append(torch.get_num_threads())
        return RunnerOutput(step=so.step)

    lane: Any = SimpleNamespace(kind=kind, has_work=has_work)
    return Worker(lane, torch.device("cpu"), num_threads, execute)


async def test_a_step_borrows_an_idle_peers_threads_and_the_peer_waits_for_it() -> None:
    before = torch.get_num_threads()
    seen: list[Any] = []
    prefill = _cpu_worker(StepKind.PREFILL, True, 1, seen)
    decode = _cpu_worker(StepKind.DECODE, False, 1, seen)
    try:
        assert ThreadLending((prefill, decode), enabled=False).borrowable(prefill) == 0
        lending = ThreadLending((prefill, decode), enabled=True)
        assert lending.borrowable(prefill) == 1, "decode is idle: its share is lent"
        assert lending.borrowable(decode) == 0, "prefill has work: nothing to borrow"
        step = asyncio.create_task(prefill.run(ScheduleOutput(step=1, chunks=()), 1))
        await asyncio.sleep(0)
        assert prefill.borrowing and not prefill.step_done.is_set()
        await asyncio.wait_for(lending.wait_for_peer(decode), timeout=60)
        assert step.done() and not prefill.borrowing
        assert seen == [2], "the step ran on both shares"
        await lending.wait_for_peer(decode)  # nothing borrowed now: returns at once
    finally:
        prefill.shutdown()
        decode.shutdown()
        torch.set_num_threads(before)


def test_busy_meter_window() -> None:
    meter = BusyMeter(window_s=10.0)
    meter._intervals.extend([(0.0, 2.0), (5.0, 6.0), (9.0, 9.5)])
    assert meter.fraction(now=10.0) == pytest.approx(0.35)
    assert meter.fraction(now=15.5) == pytest.approx(0.1)  # (5.5, 6) and (9, 9.5) remain
    assert meter.fraction(now=30.0) == 0.0


async def test_device_groups_on_other_devices_are_refused(tiny_llama_dir: Path) -> None:
    workers = WorkersConfig(decode_devices=("cuda:1",))
    with pytest.raises(ConfigError, match="decode-devices"):
        async with AsyncEngine(tiny_config(tiny_llama_dir, workers)):
            pass


async def test_gil_switch_interval_is_set_while_running_and_restored(tiny_llama_dir: Path) -> None:
    before = sys.getswitchinterval()
    config = tiny_config(tiny_llama_dir, WorkersConfig(gil_switch_interval_ms=0.25))
    async with AsyncEngine(config) as engine:
        assert sys.getswitchinterval() == pytest.approx(0.25e-3)
        assert len(await run_all(engine, token_prompts()[:2])) == 2
    assert sys.getswitchinterval() == before
    async with AsyncEngine(tiny_config(tiny_llama_dir, WorkersConfig(gil_switch_interval_ms=None))):
        assert sys.getswitchinterval() == before
    with pytest.raises(ConfigError, match="gil_switch_interval_ms"):
        tiny_config(tiny_llama_dir, WorkersConfig(gil_switch_interval_ms=0.0))


@pytest.mark.slow
async def test_the_collector_is_tuned_while_running_and_restored(tiny_llama_dir: Path) -> None:
    """What exists at start is frozen out of collection and the youngest generation waits for
    more allocations; shutdown gives the collector back as it was (nothing left frozen)."""
    before = gc.get_threshold()
    config = tiny_config(tiny_llama_dir, WorkersConfig(gc_young_threshold=12_345))
    async with AsyncEngine(config) as engine:
        assert gc.get_threshold() == (12_345, *before[1:])
        assert gc.get_freeze_count() > 1000  # the model, tokenizer and block records
        assert len(await run_all(engine, token_prompts()[:2])) == 2
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
    async with AsyncEngine(tiny_config(tiny_llama_dir, WorkersConfig(gc_young_threshold=None))):
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    with pytest.raises(ConfigError, match="gc_young_threshold"):
        tiny_config(tiny_llama_dir, WorkersConfig(gc_young_threshold=-5))
