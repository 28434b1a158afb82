"""Predicted outputs through the engine on the real SmolLM2 (the session's engine: default
flags, so no configured proposer): a request with a prediction gives the tokens the same request
gives without one (greedy and seeded, alone and beside others), whether the prediction is the
answer itself or the file before its edit; the prediction's accepted tokens are counted in the
usage, and a prediction longer than the context is refused."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.types import Usage
from deepinfer.errors import InvalidRequestError
from deepinfer.request import SamplingParams, StructuredKind, StructuredSpec
from deepinfer.text.recipe import ChatMessage

pytestmark = pytest.mark.slow

CODE = (
    "def area(width, height):\n    return width * height\n\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n\n\n"
    "def describe(width, height):\n"
    '    return f"{width} by {height}: area {area(width, height)}"\n'
)
EDIT = [
    ChatMessage(
        "user",
        "Rename the parameter `width` to `w` everywhere in this code and answer with the whole "
        f"code only.\n\n```python\n{CODE}```",
    )
]
GREEDY = SamplingParams(max_tokens=80, temperature=0.0)
SEEDED = SamplingParams(max_tokens=80, temperature=0.7, top_p=0.95, seed=3)


async def _run(
    engine: AsyncEngine, params: SamplingParams, prediction: str | None = None
) -> tuple[list[int], str, Usage]:
    ids: list[int] = []
    text: list[str] = []
    usage = None
    async for out in engine.generate(EDIT, params, prediction=prediction):
        ids.extend(out.token_ids)
        text.append(out.text)
        usage = out.usage
    assert usage is not None
    return ids, "".join(text), usage


async def test_a_prediction_leaves_the_answer_as_it_was(real_engine: AsyncEngine) -> None:
    want, answer, plain_usage = await _run(real_engine, GREEDY)
    want_seeded, _, _ = await _run(real_engine, SEEDED)
    assert plain_usage.accepted_prediction_tokens == plain_usage.rejected_prediction_tokens == 0

    got, text, usage = await _run(real_engine, GREEDY, prediction=answer)
    assert got == want and text == answer
    num_predicted = len(real_engine.tokenizer.encode(answer))
    assert usage.accepted_prediction_tokens > 0
    assert usage.accepted_prediction_tokens + usage.rejected_prediction_tokens == num_predicted

    # the file before the edit (what an editor sends), greedy and seeded, beside a request
    # without a prediction
    runs = await asyncio.gather(
        _run(real_engine, GREEDY, prediction=CODE),
        _run(real_engine, SEEDED, prediction=CODE),
        _run(real_engine, GREEDY),
    )
    assert [r[0] for r in runs] == [want, want_seeded, want]
    real_engine.check_integrity()


async def test_a_prediction_drafts_under_a_grammar(real_engine: AsyncEngine) -> None:
    """A JSON schema's answer, greedy and seeded: the prediction (the answer itself, then the
    answer as prose the grammar refuses at once) leaves the tokens as they were."""
    schema = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
    spec = StructuredSpec(StructuredKind.JSON_SCHEMA, json.dumps(schema))
    greedy, seeded = (dataclasses.replace(p, structured=spec) for p in (GREEDY, SEEDED))
    want, answer, _ = await _run(real_engine, greedy)
    want_seeded, _, _ = await _run(real_engine, seeded)
    got, _, usage = await _run(real_engine, greedy, prediction=answer)
    assert got == want and usage.accepted_prediction_tokens > 0
    runs = await asyncio.gather(
        _run(real_engine, seeded, prediction=answer),
        _run(real_engine, greedy, prediction="Here is the code: " + answer),
    )
    assert [r[0] for r in runs] == [want_seeded, want]
    real_engine.check_integrity()


async def test_a_prediction_longer_than_the_context_is_refused(real_engine: AsyncEngine) -> None:
    with pytest.raises(InvalidRequestError) as err:
        await real_engine.submit(EDIT, GREEDY, prediction="word " * (real_engine.max_model_len + 8))
    assert err.value.param == "prediction"
