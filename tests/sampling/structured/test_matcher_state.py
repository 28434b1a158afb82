"""Grammar state moves with its request: across the prefill -> decode handoff (separate device
groups, each with its own runner) and through preemption by recompute (a tiny KV pool), in both
worker modes (colocated, disaggregated); every output stays a valid instance of its schema, and every matcher is released."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from deepinfer.config import WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from tests.sampling.structured.conftest import tiny_structured_config
from tests.sampling.structured.corpus_run import invalid_outputs, run_schemas
from tests.sampling.structured.schema_corpus import schema_corpus

SPLIT = WorkersConfig(
    prefill_devices=("cpu:0",),
    decode_devices=("cpu:1",),
    prefill_step_ms=5.0,
    prefill_buckets=(16, 48),
)
PROMPT_IDS = list(range(100, 150))
"""Four blocks each (prefix caching off): the pool of 30 cannot hold the 16 requests as they
grow."""
MAX_ROUNDS = 5
MODES = {
    "colocated": WorkersConfig(colocated=True),
    "disaggregated": WorkersConfig(prefill_step_ms=5.0, prefill_buckets=(16, 48)),
    "split-groups": SPLIT,
}


@pytest.mark.slow  # runs long
@pytest.mark.parametrize("mode", sorted(MODES))
async def test_state_survives_handoff_and_preemption(tiny_llama_dir: Path, mode: str) -> None:
    schemas = [s for s in schema_corpus(96) if len(str(s)) > 400][:16]
    config = tiny_structured_config(tiny_llama_dir, MODES[mode], num_blocks=30, max_num_seqs=16)
    # no prefix sharing: each request holds its own prompt blocks, so the pool runs out
    config = dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, enable_prefix_caching=False)
    )
    async with AsyncEngine(config) as engine:
        core = engine.core
        # Whether the pool runs out depends on how the requests' admissions and growth
        # interleave, which a loaded machine changes: more rounds (each seeded its own way) until
        # one preempts, at most MAX_ROUNDS.
        for round_ in range(MAX_ROUNDS):
            temperature = 0.0 if round_ == 0 else 1.0
            schemas = schemas[1:] + schemas[:1]  # another order of arrival each round
            results = await run_schemas(engine, schemas, temperature, prompt=PROMPT_IDS)
            assert invalid_outputs(results) == []
            if round_ >= 1 and (mode == "split-groups" or core.scheduler.num_preemptions):
                break
        if mode == "split-groups":  # each group's runner: the matchers moved with the KV
            assert core.decode_runner is not core.runner
            assert engine.stats().handoffs.num_handoffs >= 2 * len(schemas)
        else:
            assert core.scheduler.num_preemptions > 0, "the pool was meant to run out"
        assert len(core.runner.matchers) == 0 and len(core.decode_runner.matchers) == 0
        engine.check_integrity()
