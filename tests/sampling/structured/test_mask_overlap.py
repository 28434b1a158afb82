"""Masks filled while the forward pass runs (`deepinfer/sampling/mask_fill.py`): the same
outputs as a fill after the forward pass (greedy and seeded sampling, both worker modes); a
matcher never in two fills at once; no fill left running when a step ends, fails, or its
request finishes or is aborted; matchers released; nothing done for unconstrained steps."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

import deepinfer.sampling.mask_fill as mask_fill
from deepinfer.config import WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.environment import default_model_path
from deepinfer.errors import RequestFailedError
from deepinfer.model.loading.gguf_loader import open_gguf
from deepinfer.request import FinishReason, SamplingParams, StructuredKind, StructuredSpec
from deepinfer.runner.model_runner import ModelRunner
from deepinfer.sampling.constraints import ConstraintCompiler
from deepinfer.sampling.mask_fill import MaskFiller
from deepinfer.sampling.matchers import MaskRow, MatcherTable, fill_rows
from deepinfer.sampling.vocabulary import vocabulary_from
from deepinfer.text.tokenizer import Tokenizer
from tests.sampling.structured.conftest import tiny_structured_config
from tests.sampling.structured.corpus_run import (
    PROMPT_IDS,
    Generated,
    invalid_outputs,
    schema_params,
)
from tests.sampling.structured.schema_corpus import schema_corpus
from tests.scheduler.sched_fakes import make_request

CPU = torch.device("cpu")
MODES = {
    "colocated": WorkersConfig(colocated=True),
    "disaggregated": WorkersConfig(prefill_step_ms=5.0, prefill_buckets=(16, 48)),
}


def _runners(engine: AsyncEngine) -> list[ModelRunner]:
    core = engine.core
    return [core.runner] if core.decode_runner is core.runner else [core.runner, core.decode_runner]


def _set_overlap(engine: AsyncEngine, on: bool | None) -> None:
    for runner in _runners(engine):
        runner.masks.overlap = on


def _assert_released(engine: AsyncEngine) -> None:
    assert all(len(r.matchers) == 0 for r in _runners(engine))
    engine.check_integrity()


async def _token_ids(engine: AsyncEngine, params: SamplingParams) -> tuple[list[int], Generated]:
    ids: list[int] = []
    reason = None
    async for out in engine.generate(PROMPT_IDS, params):
        ids.extend(out.token_ids)
        reason = out.finish_reason
    assert params.structured is not None
    text = engine.tokenizer.decode(ids, skip_special_tokens=True)
    return ids, Generated(json.loads(params.structured.source), text, reason)


async def _run(
    engine: AsyncEngine, schemas: Sequence[dict[str, object]], temperature: float
) -> tuple[list[list[int]], list[Generated]]:
    jobs = [
        _token_ids(engine, schema_params(s, temperature, seed=i)) for i, s in enumerate(schemas)
    ]
    done = await asyncio.gather(*jobs)
    return [ids for ids, _ in done], [g for _, g in done]


class FillProbe:
    """Wraps the fill job's row loop: a delay (so steps end while fills would still run), the
    fills in flight, and any matcher seen in two fills at once."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.in_flight = 0
        self.num_fills = 0
        self.busy: Counter[int] = Counter()
        self.overlaps = 0
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, words: object, rows: Sequence[MaskRow]) -> None:
        with self.lock:
            self.in_flight += 1
            self.num_fills += 1
            self.threads.add(threading.current_thread().name)
            for row in rows:
                self.overlaps += self.busy[id(row.matcher)] > 0
                self.busy[id(row.matcher)] += 1
        try:
            time.sleep(self.delay_s)
            fill_rows(words, rows)  # type: ignore[arg-type]
        finally:
            with self.lock:
                self.in_flight -= 1
                for row in rows:
                    self.busy[id(row.matcher)] -= 1


def _probe_runners(
    engine: AsyncEngine, probe: FillProbe, monkeypatch: pytest.MonkeyPatch
) -> list[int]:
    """Whenever a runner's `execute` returns or raises: how many of its step's matchers are
    still in a fill (the other lane's step may be filling its own meanwhile)."""
    seen: list[int] = []
    monkeypatch.setattr(mask_fill, "fill_rows", probe)
    for runner in _runners(engine):
        execute = runner.execute

        def checked(so, execute=execute, runner=runner):  # type: ignore[no-untyped-def]
            try:
                return execute(so)
            finally:
                matchers = [runner.matchers.get(c.request_id) for c in so.chunks]
                with probe.lock:
                    seen.append(sum(probe.busy[id(m)] > 0 for m in matchers if m is not None))

        monkeypatch.setattr(runner, "execute", checked)
    return seen


@pytest.mark.slow  # runs long
@pytest.mark.parametrize("mode", sorted(MODES))
async def test_outputs_identical_with_and_without_overlap(tiny_llama_dir: Path, mode: str) -> None:
    schemas = schema_corpus(48)[:12]
    config = tiny_structured_config(tiny_llama_dir, MODES[mode], max_num_seqs=16)
    async with AsyncEngine(config) as engine:
        for temperature in (0.0, 1.0):
            _set_overlap(engine, False)
            after_forward, _ = await _run(engine, schemas, temperature)
            if temperature == 0.0:  # the first constrained steps: no pool made without overlap
                assert not any(r.masks.has_pool for r in _runners(engine))
            _set_overlap(engine, True)
            overlapped, results = await _run(engine, schemas, temperature)
            assert overlapped == after_forward, f"temperature {temperature}"
            assert invalid_outputs(results) == []
        assert any(r.masks.has_pool for r in _runners(engine))
        _assert_released(engine)
        runners = _runners(engine)
    assert not any(r.masks.has_pool for r in runners), "shutdown leaves the fill pool running"


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
async def test_finish_and_abort_while_fills_run(
    tiny_llama_dir: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    schemas = [s for s in schema_corpus(96) if len(str(s)) > 300][:8]
    config = tiny_structured_config(tiny_llama_dir, MODES[mode], max_num_seqs=16)
    async with AsyncEngine(config) as engine:
        _set_overlap(engine, True)  # beside the forward pass, whatever the cores
        probe = FillProbe(delay_s=0.02)
        seen = _probe_runners(engine, probe, monkeypatch)

        async def abort_after(params: SamplingParams, num_tokens: int) -> int:
            got = 0
            async for out in engine.generate(PROMPT_IDS, params):
                got += len(out.token_ids)
                if got >= num_tokens:
                    break  # closing the stream aborts the request mid-step
            return got

        short = schema_params(schemas[0], 1.0, seed=5)
        short = SamplingParams(max_tokens=3, temperature=1.0, seed=5, structured=short.structured)
        jobs = [abort_after(schema_params(s, 1.0, seed=i), 2 + i) for i, s in enumerate(schemas)]
        full = asyncio.gather(*(_token_ids(engine, schema_params(s, 0.0)) for s in schemas[:4]))
        cut, finished, (_, capped) = await asyncio.gather(
            asyncio.gather(*jobs), full, _token_ids(engine, short)
        )
        assert all(n >= 2 for n in cut)
        assert invalid_outputs([g for _, g in finished]) == []
        assert capped.finish_reason is FinishReason.LENGTH
        for _ in range(100):  # aborts are applied between steps
            if all(len(r.matchers) == 0 for r in _runners(engine)):
                break
            await asyncio.sleep(0.01)
        _assert_released(engine)
        assert probe.num_fills > 0 and probe.overlaps == 0
        assert set(seen) == {0}, "a step ended while its fill still ran"
        assert all(name.startswith("deepinfer-mask-fill") for name in probe.threads)


@pytest.mark.slow
async def test_failed_forward_waits_for_its_fill(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_structured_config(tiny_llama_dir, WorkersConfig(colocated=True))
    async with AsyncEngine(config) as engine:
        _set_overlap(engine, True)
        probe = FillProbe(delay_s=0.2)
        seen = _probe_runners(engine, probe, monkeypatch)
        runner = engine.core.runner

        def broken(batch: object) -> object:
            raise RuntimeError("forward failed")

        monkeypatch.setattr(runner, "_forward", broken)
        with pytest.raises(RequestFailedError):
            await _token_ids(engine, schema_params(schema_corpus(4)[0], 0.0))
        assert seen == [0] and probe.num_fills == 1
        _assert_released(engine)
        monkeypatch.undo()  # the engine goes on serving
        ids, result = await _token_ids(engine, schema_params(schema_corpus(4)[0], 0.0))
        assert ids and invalid_outputs([result]) == []


async def test_unconstrained_steps_start_nothing(tiny_llama_dir: Path) -> None:
    config = tiny_structured_config(tiny_llama_dir, WorkersConfig(colocated=True))
    async with AsyncEngine(config) as engine:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        outs = [o async for o in engine.generate(PROMPT_IDS, params)]
        assert sum(len(o.token_ids) for o in outs) == 8
        runner = engine.core.runner
        assert not runner.masks.has_pool and len(runner.matchers) == 0
        assert runner.masks.start([], 100) is None


def test_the_fill_goes_beside_the_forward_pass_only_where_a_core_is_left() -> None:
    """The default (`overlap` None): a CPU step on every core fills after its forward pass (no
    pool made), one on fewer threads fills beside it (on the pool)."""
    tok = Tokenizer.from_gguf(open_gguf(default_model_path()))
    masks = MaskFiller(MatcherTable(ConstraintCompiler(lambda: vocabulary_from(tok, 2))), CPU)
    assert masks.overlap is None
    request = make_request("r", [1, 2], structured=StructuredSpec(StructuredKind.REGEX, "[0-9]+"))
    threads = torch.get_num_threads()
    try:
        for num_threads, pooled in ((mask_fill.NUM_CORES, False), (1, True)):
            torch.set_num_threads(num_threads)
            pending = masks.start([(request, ())], tok.vocab_size)
            assert pending is not None and masks.has_pool == pooled
            digit = tok.encode("7")[0]
            assert pending.wait()[0, digit] == 0 and pending.wait()[0, tok.encode("x")[0]] < 0
    finally:
        torch.set_num_threads(threads)
        masks.close()
