"""The whole schema corpus on the tiny random model at temperature 0, 32 requests at once:
every output is a finished, valid instance of its schema."""

from __future__ import annotations

import pytest

from deepinfer.engine.async_engine import AsyncEngine
from tests.sampling.structured.corpus_run import invalid_outputs, run_schemas
from tests.sampling.structured.schema_corpus import schema_corpus


def test_corpus_is_large_and_varied() -> None:
    corpus = schema_corpus()
    text = str(corpus)
    assert len(corpus) >= 300
    for feature in ("anyOf", "$ref", "pattern", "format", "maxItems", "enum", "required", "名前"):
        assert feature in text, feature


@pytest.mark.slow  # runs long
async def test_whole_corpus_greedy(tiny_structured_engine: AsyncEngine) -> None:
    results = await run_schemas(tiny_structured_engine, schema_corpus(), temperature=0.0)
    assert invalid_outputs(results) == []
    tiny_structured_engine.check_integrity()
