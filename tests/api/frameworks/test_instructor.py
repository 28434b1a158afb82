"""instructor over the OpenAI SDK: a validated pydantic object in TOOLS, JSON and JSON_SCHEMA modes,
and in RESPONSES_TOOLS mode (a named tool and `text.format` with the same schema, together)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from pydantic import BaseModel

instructor = pytest.importorskip(
    "instructor",
    reason="instructor is not installed: instructor 1.17 pins jiter<0.15, which openai>=3.31 "
    "cannot satisfy, so it is not in the test extra (pip install --no-deps instructor)",
)

pytestmark = [pytest.mark.slow, pytest.mark.frameworks]


class City(BaseModel):
    """A city and its country."""

    name: str
    country: str


class Place(BaseModel):
    # No docstring: JSON mode prompts with the schema, which the model echoes if it has one.
    name: str
    country: str


ASKS: dict[str, tuple[type[BaseModel], str]] = {
    "TOOLS": (City, "Which city is the capital of France?"),
    "JSON_SCHEMA": (City, "Which city is the capital of France?"),
    # JSON mode constrains to any JSON object and puts the schema only in the prompt, which the
    # 135M model does not follow unprompted: the object is spelled out for it.
    "JSON": (Place, 'Return the JSON object {"name": "Paris", "country": "France"}.'),
}


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0) as c:
        yield c


@pytest.mark.parametrize("mode", ["TOOLS", "JSON", "JSON_SCHEMA"])
def test_mode_returns_a_validated_object(client: openai.OpenAI, mode: str) -> None:
    if not hasattr(instructor.Mode, mode):
        pytest.skip(f"this instructor has no Mode.{mode}")
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    response_model, question = ASKS[mode]
    city = patched.chat.completions.create(
        model="smollm2",
        response_model=response_model,
        max_retries=0,
        temperature=0,
        max_tokens=96,
        messages=[{"role": "user", "content": question}],
    )
    assert isinstance(city, response_model)
    assert all(str(value).strip() for value in city.model_dump().values())


def test_responses_tools_mode_returns_a_validated_object(client: openai.OpenAI) -> None:
    """RESPONSES_TOOLS sends a forced (named) tool and a `text.format` of the same schema in one
    request: the answer is the call, read back as the object."""
    patched = instructor.from_openai(client, mode=instructor.Mode.RESPONSES_TOOLS)
    city = patched.responses.create(
        model="smollm2",
        response_model=City,
        max_retries=0,
        temperature=0,
        max_tokens=96,
        input=[{"role": "user", "content": "Which city is the capital of France?"}],
    )
    assert isinstance(city, City)
    assert all(str(value).strip() for value in city.model_dump().values())
