"""dspy's native tool calling (`JSONAdapter(use_native_function_calling=True)`): it sends the
tools and a `response_format` for its output fields together; with the call forced, the tool
call comes back as native `tool_calls` and dspy runs it (the format constrains only text)."""

from __future__ import annotations

from typing import Any

import pytest

dspy = pytest.importorskip("dspy", reason="dspy is not installed (pip install dspy)")
from dspy import JSONAdapter, Signature, Tool, ToolCalls  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.frameworks]

RAN: list[str] = []


def get_weather(city: str) -> str:
    """Current weather in a city."""
    RAN.append(city)
    return f"Sunny in {city}"


class Ask(Signature):
    """Call the weather tool for the city in the question."""

    question: str = dspy.InputField()
    tools: list[Tool] = dspy.InputField()
    outputs: ToolCalls = dspy.OutputField()


def test_native_tool_call_beside_a_response_format(base_url: str) -> None:
    # A model name litellm knows to take tools and `response_format` (this server answers to any
    # name): under another, dspy falls back to tools described in the prompt.
    lm = dspy.LM(
        "openai/gpt-4o-mini", api_base=base_url, api_key="x", temperature=0, max_tokens=128,
        cache=False, num_retries=0, tool_choice="required",
    )  # fmt: skip
    tool = Tool(get_weather)
    with dspy.context(lm=lm, adapter=JSONAdapter(use_native_function_calling=True)):
        pred = dspy.Predict(Ask)(question="What is the weather in Paris?", tools=[tool])
    sent: dict[str, Any] = lm.history[-1]["kwargs"]
    assert sent["tools"] and sent["response_format"] is not None, sorted(sent)
    calls = pred.outputs.tool_calls
    assert calls and all(c.name == "get_weather" and set(c.args) == {"city"} for c in calls)
    assert calls[0].execute(functions=[tool]).startswith("Sunny in")
    assert RAN
