"""Reasoning answers through the official SDKs: the think block comes back as OpenAI
`reasoning_content` (streamed as its own deltas) and Anthropic `thinking` blocks (streamed as
`thinking_delta`s), split by the marker ids the fake model samples; the same text typed as plain
characters stays content. The thinking switches reach the recipe."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from deepinfer.text.reasoning import ReasoningFormat
from tests.api.fake_engine import THINK, THINK_CLOSE_ID, THINK_OPEN_ID, FakeEngine
from tests.api.live_server import LiveServer

REASONED = "\x00<think>\nThe user greets me.\n\x00</think>\n\nHello! <think>not reasoning</think>"
SPELLED = "<think>typed</think>\n\nanswer"
"""A reply spelling the markers in plain characters (as an echo of a client's text would)."""
FORMAT = ReasoningFormat(THINK_OPEN_ID, THINK_CLOSE_ID, THINK[THINK_OPEN_ID], THINK[THINK_CLOSE_ID])
HI: Any = [{"role": "user", "content": "hi"}]


@pytest.fixture
def reasoning_model(fake_engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The fake engine as a reasoning model; yields the recorded `enable_thinking` values."""
    monkeypatch.setattr(fake_engine.recipe, "reasoning", FORMAT)
    seen: list[Any] = []
    encode = fake_engine.recipe.encode

    def recording(messages: Any, **kwargs: Any) -> list[int]:
        seen.append(kwargs.get("enable_thinking"))
        return encode(messages, **kwargs)

    monkeypatch.setattr(fake_engine.recipe, "encode", recording)
    yield seen


def openai_client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def test_openai_reasoning_content(
    fake_server: LiveServer, fake_engine: FakeEngine, reasoning_model: list[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(fake_engine, "reply", REASONED)
    with openai_client(fake_server) as c:
        answer = c.chat.completions.create(model="m", messages=HI, max_tokens=200)
        chunks = list(
            c.chat.completions.create(
                model="m", messages=HI, max_tokens=200, stream=True,
                extra_body={"chat_template_kwargs": {"enable_thinking": True}},
            )
        )  # fmt: skip
    message = answer.choices[0].message
    assert message.reasoning_content == "The user greets me."  # type: ignore[attr-defined]
    assert message.content == "Hello! <think>not reasoning</think>"
    deltas = [k.choices[0].delta for k in chunks if k.choices]
    thoughts = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]  # type: ignore[attr-defined]
    contents = [d.content for d in deltas if d.content]
    assert len(thoughts) > 1 and "".join(thoughts) == "The user greets me."
    assert "".join(contents) == message.content
    last_thought = max(i for i, d in enumerate(deltas) if getattr(d, "reasoning_content", None))
    first_content = min(i for i, d in enumerate(deltas) if d.content)
    assert last_thought < first_content
    assert reasoning_model == [None, True]


def test_spelled_markers_stay_content(
    fake_server: LiveServer, fake_engine: FakeEngine, reasoning_model: list[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(fake_engine, "reply", SPELLED)
    with openai_client(fake_server) as c:
        answer = c.chat.completions.create(model="m", messages=HI, max_tokens=200)
        streamed = c.chat.completions.create(model="m", messages=HI, max_tokens=200, stream=True)
        deltas = [k.choices[0].delta for k in streamed if k.choices]
    assert answer.choices[0].message.content == SPELLED
    assert answer.choices[0].message.reasoning_content is None  # type: ignore[attr-defined]
    assert "".join(d.content or "" for d in deltas) == SPELLED
    assert not any(getattr(d, "reasoning_content", None) for d in deltas)
    with anthropic.Anthropic(base_url=fake_server.url, api_key="x", max_retries=0) as c:
        message = c.messages.create(model="m", max_tokens=200, messages=HI)
    assert [b.type for b in message.content] == ["text"]


def test_anthropic_thinking_blocks(
    fake_server: LiveServer, fake_engine: FakeEngine, reasoning_model: list[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(fake_engine, "reply", REASONED)
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    with anthropic.Anthropic(base_url=fake_server.url, api_key="x", max_retries=0) as c:
        message = c.messages.create(model="m", max_tokens=2000, messages=HI, thinking=thinking)
        with c.messages.stream(
            model="m", max_tokens=2000, messages=HI, thinking={"type": "disabled"}
        ) as stream:
            events = list(stream)
            final = stream.get_final_message()
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "The user greets me."  # type: ignore[union-attr]
    assert message.content[1].text == "Hello! <think>not reasoning</think>"  # type: ignore[union-attr]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas.count("thinking_delta") > 1 and "text_delta" in deltas
    assert deltas.index("text_delta") > max(
        i for i, d in enumerate(deltas) if d == "thinking_delta"
    )
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "The user greets me."  # type: ignore[union-attr]
    assert final.content[1].text == message.content[1].text  # type: ignore[union-attr]
    assert reasoning_model == [True, False]


@pytest.mark.parametrize(
    ("thinking", "field"),
    [
        ({"type": "enabled", "budget_tokens": 100}, "thinking.budget_tokens"),
        ({"type": "enabled", "budget_tokens": 4096}, "thinking.budget_tokens"),  # >= max_tokens
        ({"type": "adaptive"}, "thinking.type"),
    ],
)
def test_anthropic_thinking_is_checked(
    fake_server: LiveServer, thinking: dict[str, Any], field: str
) -> None:
    with (
        anthropic.Anthropic(base_url=fake_server.url, api_key="x", max_retries=0) as c,
        pytest.raises(anthropic.BadRequestError) as raised,
    ):
        c.messages.create(model="m", max_tokens=2000, messages=HI, thinking=thinking)  # type: ignore[arg-type]
    assert field in str(raised.value)


def test_responses_reasoning_items(
    fake_server: LiveServer, fake_engine: FakeEngine, reasoning_model: list[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(fake_engine, "reply", REASONED)
    with openai_client(fake_server) as c:
        response = c.responses.create(model="m", input="hi", max_output_tokens=200)
        events = list(c.responses.create(model="m", input="hi", stream=True))
        follow_up = c.responses.create(
            model="m",
            input=[*response.output, {"role": "user", "content": "and?"}],  # type: ignore[list-item]
        )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content is not None and reasoning.content[0].text == "The user greets me."
    assert response.output_text == "Hello! <think>not reasoning</think>"
    kinds = [e.type for e in events]
    assert kinds.count("response.reasoning_text.delta") > 1
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    done = events[-1]
    assert done.type == "response.completed"
    assert [item.type for item in done.response.output] == ["reasoning", "message"]
    assert done.response.output_text == response.output_text
    assert follow_up.output_text == response.output_text
