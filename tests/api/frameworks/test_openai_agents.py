"""openai-agents: an Agent with a function tool over the Responses and the Chat Completions models."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

agents = pytest.importorskip(
    "agents", reason="openai-agents is not installed (pip install openai-agents)"
)
from agents import (  # noqa: E402
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunHooks,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.models.interface import Model  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.frameworks]

FORECAST = "sunny, 21 C, forecast id 7731"
"""What the tool returns: the next model call must carry it."""


class Inputs(RunHooks[Any]):
    """Records the input items of each model call."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []

    async def on_llm_start(
        self, context: Any, agent: Any, system_prompt: Any, input_items: Any
    ) -> None:
        self.calls.append(list(input_items))


@pytest.fixture
async def client(base_url: str) -> AsyncIterator[AsyncOpenAI]:
    set_tracing_disabled(True)
    async with AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as c:
        yield c


def weather_agent(model: Model, ran: list[str]) -> Agent[Any]:
    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        ran.append(city)
        return FORECAST

    return Agent(
        name="weather",
        instructions="Call the weather tool, then reply in one short sentence.",
        tools=[get_weather],
        model=model,
        # one call: with parallel calls allowed the model may keep calling until max_tokens
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=128
        ),
    )


async def run_forced(model: Model, streamed: bool) -> None:
    ran: list[str] = []
    hooks = Inputs()
    agent, question = weather_agent(model, ran), "What is the weather in Paris?"
    if streamed:
        run = Runner.run_streamed(agent, question, hooks=hooks, max_turns=4)
        events = [event.type async for event in run.stream_events()]
        assert "raw_response_event" in events
        final_output = run.final_output
    else:
        final_output = (await Runner.run(agent, question, hooks=hooks, max_turns=4)).final_output
    assert ran, "the forced tool did not run"
    assert len(hooks.calls) >= 2
    assert FORECAST in str(hooks.calls[1]), "the tool's output did not reach the next model call"
    assert isinstance(final_output, str) and final_output.strip()


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_responses_model(client: AsyncOpenAI, streamed: bool) -> None:
    await run_forced(OpenAIResponsesModel(model="smollm2", openai_client=client), streamed)


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_chat_completions_model(client: AsyncOpenAI, streamed: bool) -> None:
    await run_forced(OpenAIChatCompletionsModel(model="smollm2", openai_client=client), streamed)


MARKUP = ("<tool_call", "tool_call>", "<tool_response", '{"name":')


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_forced_call_cut_by_max_tokens_leaks_no_markup(
    client: AsyncOpenAI, streamed: bool
) -> None:
    """With a forced tool and parallel calls, this model repeats its call until max_tokens cuts
    the next one: the cut answer is its complete calls only (no text), so the history the agent
    sends back holds no call markup as an assistant message."""
    ran: list[str] = []
    hooks = Inputs()
    agent = weather_agent(
        OpenAIChatCompletionsModel(model="smollm2", openai_client=client), ran
    ).clone(model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=40))
    question = "What is the weather in Paris?"
    if streamed:
        run = Runner.run_streamed(agent, question, hooks=hooks, max_turns=2)
        async for _ in run.stream_events():
            pass
        first = run.raw_responses[0]
    else:
        first = (await Runner.run(agent, question, hooks=hooks, max_turns=2)).raw_responses[0]
    assert [item.type for item in first.output] == ["function_call"], first.output
    assert ran == ["Paris"] and len(hooks.calls) == 2
    sent_back = [i for i in hooks.calls[1] if isinstance(i, dict) and i.get("role") == "assistant"]
    assert not any(m in str(i) for i in sent_back for m in MARKUP), sent_back
    assert FORECAST in str(hooks.calls[1])
