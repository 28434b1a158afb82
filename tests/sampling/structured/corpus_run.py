"""Running schemas through an engine and checking every output against its schema."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import jsonschema

from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.types import GenerationOutput
from deepinfer.request import FinishReason, SamplingParams, StructuredKind, StructuredSpec

PROMPT_IDS = [100, 2000, 300, 4000]
MAX_TOKENS = 400
"""Above the corpus's longest output on the tiny random model (~250 tokens sampled)."""


@dataclass(frozen=True)
class Generated:
    schema: dict[str, Any]
    text: str
    finish_reason: FinishReason | None


def schema_params(schema: dict[str, Any], temperature: float, seed: int = 0) -> SamplingParams:
    spec = StructuredSpec(StructuredKind.JSON_SCHEMA, json.dumps(schema))
    return SamplingParams(
        max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, structured=spec
    )


async def generate(engine: AsyncEngine, prompt: Any, params: SamplingParams) -> Generated:
    ids: list[int] = []
    last: GenerationOutput | None = None
    async for out in engine.generate(prompt, params):
        ids.extend(out.token_ids)
        last = out
    assert last is not None
    text = engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert params.structured is not None
    return Generated(json.loads(params.structured.source), text, last.finish_reason)


async def run_schemas(
    engine: AsyncEngine, schemas: list[dict[str, Any]], temperature: float, prompt: Any = None
) -> list[Generated]:
    jobs = [
        generate(engine, prompt or PROMPT_IDS, schema_params(s, temperature, seed=i))
        for i, s in enumerate(schemas)
    ]
    return list(await asyncio.gather(*jobs))


def invalid_outputs(results: list[Generated]) -> list[str]:
    """A line per output that is not a finished, valid instance of its schema."""
    bad: list[str] = []
    checker = jsonschema.FormatChecker()
    for i, r in enumerate(results):
        try:
            assert r.finish_reason is FinishReason.STOP, f"finished by {r.finish_reason}"
            jsonschema.validate(json.loads(r.text), r.schema, format_checker=checker)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            bad.append(f"#{i} {r.text[:120]!r}: {str(exc)[:160]}")
    return bad
