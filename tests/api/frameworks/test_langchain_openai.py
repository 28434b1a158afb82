"""langchain-openai's ChatOpenAI: `bind_tools` with a forced `tool_choice`, and
`with_structured_output` by its default method, `json_schema` and `function_calling`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import BaseModel, SecretStr

from tests.api.frameworks.recorder import Recorder

langchain_openai = pytest.importorskip(
    "langchain_openai", reason="langchain-openai is not installed (pip install langchain-openai)"
)
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.frameworks]

FORECAST = "sunny, 21 C, forecast id 7731"


class City(BaseModel):
    """A city and its country."""

    name: str
    country: str


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return FORECAST


@pytest.fixture
def llm(base_url: str, recorder: Recorder) -> Iterator[ChatOpenAI]:
    http = recorder.http_client()
    with http:
        yield ChatOpenAI(
            model="smollm2", base_url=base_url, api_key=SecretStr("x"), max_retries=0,
            temperature=0, max_completion_tokens=96, http_client=http,
        )  # fmt: skip


@pytest.mark.parametrize("choice", ["get_weather", "any"])
def test_bind_tools(llm: ChatOpenAI, recorder: Recorder, choice: str) -> None:
    bound = llm.bind_tools([get_weather], tool_choice=choice, parallel_tool_calls=False)
    question = HumanMessage("What is the weather in Paris?")
    ai = bound.invoke([question])
    assert isinstance(ai, AIMessage) and len(ai.tool_calls) == 1
    call = ai.tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
    result = get_weather.invoke(call)
    assert isinstance(result, ToolMessage) and result.content == FORECAST
    answer = llm.bind_tools([get_weather]).invoke([question, ai, result])
    assert FORECAST in recorder.bodies[-1]
    assert isinstance(answer, AIMessage) and (answer.content or answer.tool_calls)


@pytest.mark.parametrize("method", [None, "json_schema", "function_calling"])
def test_with_structured_output(llm: ChatOpenAI, recorder: Recorder, method: str | None) -> None:
    kwargs = {} if method is None else {"method": method}
    structured = llm.with_structured_output(City, **kwargs)  # type: ignore[arg-type]
    city = structured.invoke("Which city is the capital of France?")
    assert isinstance(city, City) and city.name.strip() and city.country.strip()
    wire = "tool_choice" if method == "function_calling" else "response_format"
    assert f'"{wire}"' in recorder.bodies[-1]
