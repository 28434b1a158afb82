"""Speculation under grammars, on the tiny random model: with n-gram drafts verified at every
step (the gate off), schemas from the corpus give exactly the tokens they give without drafts,
greedy and seeded at temperature 1, 64 requests at once, while drafts are verified and kept (the
random model repeats itself, so prompt lookup finds runs) and some are refused by the grammar."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from deepinfer.config import SpeculativeConfig, WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.request import SamplingParams
from tests.sampling.structured.conftest import tiny_structured_config
from tests.sampling.structured.corpus_run import PROMPT_IDS, schema_params
from tests.sampling.structured.schema_corpus import schema_corpus

pytestmark = pytest.mark.slow


async def _ids(engine: AsyncEngine, params: SamplingParams) -> list[int]:
    ids: list[int] = []
    async for out in engine.generate(PROMPT_IDS, params):
        ids.extend(out.token_ids)
    return ids


async def _all(engine: AsyncEngine, params: list[SamplingParams]) -> list[list[int]]:
    return list(await asyncio.gather(*(_ids(engine, p) for p in params)))


async def test_drafts_leave_constrained_outputs_as_they_were(tiny_llama_dir: Path) -> None:
    schemas = schema_corpus()[::10][:32]
    params = [
        schema_params(s, temperature, seed=i)
        for temperature in (0.0, 1.0)
        for i, s in enumerate(schemas)
    ]
    plain_config = tiny_structured_config(tiny_llama_dir, WorkersConfig(colocated=True))
    async with AsyncEngine(plain_config) as plain:
        want = await _all(plain, params)
    every_draft = SpeculativeConfig(speculative="ngram", speculative_gate="off")
    config = dataclasses.replace(plain_config, speculative=every_draft)
    async with AsyncEngine(config) as engine:
        got = await _all(engine, params)
        counts = engine.stats().speculative
        engine.check_integrity()
    assert got == want
    assert counts.num_accepted > 0
    assert counts.num_drafted > counts.num_accepted  # some refused (by the model or grammar)
