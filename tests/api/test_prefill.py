"""Prefill through the official SDKs: OpenAI's `continue_final_message` and Anthropic's trailing
assistant message reach the engine as the recipe's open final turn, and the answer is only the
continuation; `chat_template_kwargs` takes the keys the recipe knows and names any other."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from deepinfer.text.recipe import ChatMessage
from tests.api.fake_engine import REPLY, FakeEngine
from tests.api.live_server import LiveServer

PREFILL = {"add_generation_prompt": False, "continue_final_message": True}


@pytest.fixture
def prompts(fake_engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The prompt ids of every request the engine receives."""
    seen: list[list[int]] = []
    submit = fake_engine.submit

    async def recording(prompt: Any, params: Any, **kwargs: Any) -> Any:
        seen.append(list(prompt))
        return await submit(prompt, params, **kwargs)

    monkeypatch.setattr(fake_engine, "submit", recording)
    yield seen


def open_turn(engine: FakeEngine, messages: list[ChatMessage]) -> list[int]:
    return engine.recipe.encode(messages, add_generation_prompt=False, continue_final_message=True)


def test_openai_continue_final_message(
    fake_server: LiveServer, fake_engine: FakeEngine, prompts: list[list[int]]
) -> None:
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Sure:"}]
    with openai.OpenAI(base_url=fake_server.url + "/v1", api_key="x", max_retries=0) as c:
        answer = c.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=200,
            extra_body=PREFILL,  # type: ignore[arg-type]
        )
        stream = c.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=200,
            stream=True,
            extra_body=PREFILL,  # type: ignore[arg-type]
        )
        streamed = "".join(k.choices[0].delta.content or "" for k in stream if k.choices)
    expected = open_turn(
        fake_engine, [ChatMessage("user", "Say hi"), ChatMessage("assistant", "Sure:")]
    )
    assert prompts == [expected, expected]
    assert fake_engine.tokenizer.decode(expected).endswith("<|im_start|>assistant\nSure:")
    assert answer.choices[0].message.content == REPLY == streamed  # the continuation only


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"chat_template_kwargs": {"thinking_budget": 3}}, "chat_template_kwargs.thinking_budget"),
        ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ],
)
def test_openai_prompt_fields_name_the_problem(
    fake_server: LiveServer, body: dict[str, Any], param: str
) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    with (
        openai.OpenAI(base_url=fake_server.url + "/v1", api_key="x", max_retries=0) as c,
        pytest.raises(openai.BadRequestError) as raised,
    ):
        c.chat.completions.create(model="m", messages=messages, extra_body=body)  # type: ignore[arg-type]
    assert raised.value.body["param"] == param  # type: ignore[index]


def test_openai_continue_needs_an_assistant_message(fake_server: LiveServer) -> None:
    with (
        openai.OpenAI(base_url=fake_server.url + "/v1", api_key="x", max_retries=0) as c,
        pytest.raises(openai.BadRequestError) as raised,
    ):
        c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], extra_body=PREFILL
        )
    assert raised.value.body["param"] == "messages"  # type: ignore[index]


def test_openai_enable_thinking_is_accepted(
    fake_server: LiveServer, prompts: list[list[int]]
) -> None:
    """A model without a thinking switch takes `enable_thinking` and renders as its template
    does: unchanged."""
    messages = [{"role": "user", "content": "hi"}]
    with openai.OpenAI(base_url=fake_server.url + "/v1", api_key="x", max_retries=0) as c:
        for flag in (True, False):
            body = {"chat_template_kwargs": {"enable_thinking": flag}}
            c.chat.completions.create(model="m", messages=messages, max_tokens=2, extra_body=body)  # type: ignore[arg-type]
    assert prompts[0] == prompts[1]


def test_anthropic_trailing_assistant_is_a_prefill(
    fake_server: LiveServer, fake_engine: FakeEngine, prompts: list[list[int]]
) -> None:
    messages: Any = [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Sure:"}]},
    ]
    with anthropic.Anthropic(base_url=fake_server.url, api_key="x", max_retries=0) as c:
        message = c.messages.create(model="m", max_tokens=200, messages=messages)
        with c.messages.stream(model="m", max_tokens=200, messages=messages) as stream:
            streamed = "".join(stream.text_stream)
        count = c.messages.count_tokens(model="m", messages=messages)
    expected = open_turn(
        fake_engine, [ChatMessage("user", "Say hi"), ChatMessage("assistant", "Sure:")]
    )
    assert prompts == [expected, expected]
    assert count.input_tokens == len(expected)
    assert message.content[0].type == "text" and message.content[0].text == REPLY == streamed


def test_anthropic_prefill_with_trailing_whitespace_is_refused(fake_server: LiveServer) -> None:
    messages: Any = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure "}]
    with (
        anthropic.Anthropic(base_url=fake_server.url, api_key="x", max_retries=0) as c,
        pytest.raises(anthropic.BadRequestError) as raised,
    ):
        c.messages.create(model="m", max_tokens=20, messages=messages)
    assert "messages.1.content" in str(raised.value) and "trailing whitespace" in str(raised.value)


@pytest.mark.slow
def test_prefill_on_the_real_engine(real_server: LiveServer) -> None:
    """SmolLM2, greedy: the continued chat answers exactly as a completion of the recipe's open
    final turn does, through both SDKs."""
    engine: Any = real_server.config.app.state.engine
    turns = [ChatMessage("user", "Name a fruit."), ChatMessage("assistant", "A fruit I like is")]
    prompt = engine.recipe.encode(turns, add_generation_prompt=False, continue_final_message=True)
    messages: Any = [{"role": m.role, "content": m.content} for m in turns]
    with openai.OpenAI(base_url=real_server.url + "/v1", api_key="x", max_retries=0) as c:
        reference = c.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0)
        chat = c.chat.completions.create(
            model="m", messages=messages, max_tokens=8, temperature=0, extra_body=PREFILL
        )
    with anthropic.Anthropic(base_url=real_server.url, api_key="x", max_retries=0) as a:
        message = a.messages.create(
            model="m", messages=messages, max_tokens=8, extra_body={"temperature": 0}
        )
    assert chat.usage is not None and chat.usage.prompt_tokens == len(prompt)
    assert chat.choices[0].message.content == reference.choices[0].text
    assert message.content[0].type == "text"
    assert message.content[0].text == reference.choices[0].text
