"""Predicted Outputs through the official openai SDK against the live server on the real
SmolLM2 (default flags: no proposer configured): with `prediction` the answer is the one the
request gives without it, streamed or not, and the usage reports the prediction's accepted and
rejected tokens as OpenAI's does."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.api.live_server import LiveServer

pytestmark = pytest.mark.slow

CODE = (
    "def total(prices):\n    result = 0\n    for price in prices:\n"
    "        result += price\n    return result\n"
)
MESSAGES: list[Any] = [
    {
        "role": "user",
        "content": f"Rename `result` to `acc` in this code; answer with the code only.\n\n{CODE}",
    }
]


@pytest.fixture(scope="module")
def oai(real_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=real_server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def _ask(oai: openai.OpenAI, prediction: Any = None) -> Any:
    kwargs = {"prediction": prediction} if prediction is not None else {}
    return oai.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=64, temperature=0, **kwargs
    )


def test_a_prediction_keeps_the_answer_and_reports_its_tokens(oai: openai.OpenAI) -> None:
    plain = _ask(oai)
    answer = plain.choices[0].message.content
    assert answer and plain.usage is not None and plain.usage.completion_tokens_details is None

    r = _ask(oai, {"type": "content", "content": answer})
    assert r.choices[0].message.content == answer
    assert r.usage is not None and r.usage.completion_tokens == plain.usage.completion_tokens
    details = r.usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens
    assert details.accepted_prediction_tokens > r.usage.completion_tokens // 2
    assert details.rejected_prediction_tokens is not None

    parts = [{"type": "text", "text": CODE[:20]}, {"type": "text", "text": CODE[20:]}]
    stream = oai.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=64,
        temperature=0,
        prediction={"type": "content", "content": parts},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    got = usage.completion_tokens_details
    assert got.accepted_prediction_tokens is not None and got.rejected_prediction_tokens is not None
    assert got.accepted_prediction_tokens + got.rejected_prediction_tokens > 0
