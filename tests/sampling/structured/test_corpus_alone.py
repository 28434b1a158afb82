"""Every tenth schema of the corpus alone (one request in the engine at a time), at temperature
0 and 1: the same validity as 32 at once, with no batch to share masks with."""

from __future__ import annotations

import pytest

from deepinfer.engine.async_engine import AsyncEngine
from tests.sampling.structured.corpus_run import invalid_outputs, run_schemas
from tests.sampling.structured.schema_corpus import schema_corpus


@pytest.mark.slow  # runs long
@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_corpus_subset_alone(tiny_structured_engine: AsyncEngine, temperature: float) -> None:
    results = []
    for schema in schema_corpus()[::10]:
        results += await run_schemas(tiny_structured_engine, [schema], temperature)
    assert len(results) >= 32
    assert invalid_outputs(results) == []
    tiny_structured_engine.check_integrity()
