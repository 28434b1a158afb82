"""pydantic-ai over the OpenAI-compatible provider: a function tool, and pydantic `output_type`
by output tool (the default) and by native structured output (`response_format`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

from tests.api.frameworks.recorder import Recorder

pydantic_ai = pytest.importorskip(
    "pydantic_ai", reason="pydantic-ai is not installed (pip install 'pydantic-ai-slim[openai]')"
)
from pydantic_ai import Agent, NativeOutput, RunContext  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402
from pydantic_ai.settings import ModelSettings  # noqa: E402
from pydantic_ai.usage import UsageLimits  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.frameworks]

FORECAST = "sunny, 21 C, forecast id 7731"
LIMITS = UsageLimits(request_limit=3)


class City(BaseModel):
    name: str
    country: str


class Forecast(BaseModel):
    city: str
    summary: str = Field(max_length=60)  # greedy SmolLM2 can run on inside a string


@pytest.fixture
async def model(base_url: str, recorder: Recorder) -> AsyncIterator[OpenAIChatModel]:
    client = AsyncOpenAI(
        base_url=base_url, api_key="x", max_retries=0, http_client=recorder.async_http_client()
    )
    async with client:
        yield OpenAIChatModel("smollm2", provider=OpenAIProvider(openai_client=client))


def tool_then_output(ctx: RunContext[Any]) -> ModelSettings:
    """The weather tool on the first step, the output tool after (the model would otherwise
    choose; pydantic-ai refuses a static 'required')."""
    first = ctx.run_step == 1
    return ModelSettings(
        temperature=0,
        max_tokens=128,
        parallel_tool_calls=False,
        tool_choice=["get_weather"] if first else ["final_result"],
    )


async def test_tool_result_reaches_the_output(model: OpenAIChatModel, recorder: Recorder) -> None:
    ran: list[str] = []
    agent = Agent(
        model,
        output_type=Forecast,
        instructions="Use the weather tool.",
        model_settings=tool_then_output,
    )

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        ran.append(city)
        return FORECAST

    result = await agent.run("What is the weather in Paris?", usage_limits=LIMITS)
    assert ran, "the forced tool did not run"
    assert len(recorder.bodies) == 2 and FORECAST in recorder.bodies[1]
    assert isinstance(result.output, Forecast) and result.output.city.strip()


@pytest.mark.parametrize("native", [False, True], ids=["output_tool", "native_output"])
async def test_output_type(model: OpenAIChatModel, recorder: Recorder, native: bool) -> None:
    agent = Agent(
        model,
        output_type=NativeOutput(City) if native else City,
        model_settings=ModelSettings(temperature=0, max_tokens=128),
    )
    result = await agent.run("Which city is the capital of France?", usage_limits=LIMITS)
    assert isinstance(result.output, City) and result.output.name.strip()
    assert ('"response_format"' in recorder.bodies[0]) == native
