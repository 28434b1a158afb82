"""The whole schema corpus on the tiny random model at temperature 1 (seeded), 32 requests at
once: every output is a finished, valid instance of its schema."""

from __future__ import annotations

import pytest

from deepinfer.engine.async_engine import AsyncEngine
from tests.sampling.structured.corpus_run import invalid_outputs, run_schemas
from tests.sampling.structured.schema_corpus import schema_corpus


@pytest.mark.slow  # runs long
async def test_whole_corpus_sampled(tiny_structured_engine: AsyncEngine) -> None:
    results = await run_schemas(tiny_structured_engine, schema_corpus(), temperature=1.0)
    assert invalid_outputs(results) == []
    assert len({r.text for r in results}) > 250  # sampled, not one answer
