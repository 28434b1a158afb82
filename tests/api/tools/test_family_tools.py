"""Tool calling in Mistral's and Llama 3.1's markup, end to end: the openai SDK (and the
anthropic one) against the live server over a fake engine that encodes with the family's real recipe (SmolLM2's vocabulary with
the family's control tokens, as in the recipe tests) and replies in the family's call markup,
control tokens as ids, detokenized as the engine does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import anthropic
import gguf
import openai
import pytest

from deepinfer.api.app import create_app
from deepinfer.environment import default_model_path
from deepinfer.model.loading.gguf_loader import open_gguf
from deepinfer.server_config import ServerConfig
from deepinfer.text.recipe_families import recipe_for
from deepinfer.text.tokenizer import Tokenizer
from tests.api.fake_engine import FakeEngine
from tests.api.live_server import LiveServer
from tests.text.test_recipe_families import write_tokenizer_gguf
from tests.text.test_recipe_family_tools import FAMILIES

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
USER: list[Any] = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
MISTRAL_CALLS = ' [{"name": "get_weather", "arguments": {"city": "Paris"}}, ' + (
    '{"name": "get_weather", "arguments": {"city": "Oslo {x}"}, "id": "abcdefghi"}]'
)
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


class Served(NamedTuple):
    family: str
    engine: FakeEngine
    client: openai.OpenAI
    url: str


def family_tokenizer(name: str, root: Path) -> Tokenizer:
    template, controls, bos, eos, user = FAMILIES[name]
    path = root / f"{name}.gguf"
    write_tokenizer_gguf(path, open_gguf(default_model_path()), template, controls, bos, eos, user)
    return Tokenizer.from_gguf(gguf.GGUFReader(path))


@pytest.fixture(scope="module", params=["mistral", "llama3.1", "gemma3"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    name = request.param
    engine = FakeEngine(recipe=recipe_for(family_tokenizer(name, tmp_path_factory.mktemp(name))))
    server = LiveServer(create_app(engine, ServerConfig())).start()
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
            yield Served(name, engine, client, server.url)
    finally:
        server.stop()


def scripted(engine: FakeEngine, *parts: str) -> None:
    """The reply: each part as text, or the control token it names when it is one."""
    tok = engine.tokenizer
    ids: list[int] = []
    for part in parts:
        token_id = tok.token_to_id(part)
        ids += [token_id] if token_id in tok.special_token_ids else tok.encode(part)
    engine.reply_ids = ids


def answers(name: str) -> list[tuple[tuple[str, ...], list[tuple[str, dict[str, Any]]], str]]:
    """(reply parts, calls parsed, content) for the family."""
    if name == "mistral":
        return [
            (("Let me check.", "[TOOL_CALLS]", MISTRAL_CALLS),
             [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo {x}"})],
             "Let me check."),
            (("[TOOL_CALLS]" + MISTRAL_CALLS,), [], "[TOOL_CALLS]" + MISTRAL_CALLS),
        ]  # fmt: skip
    return [
        ((LLAMA_CALL,), [("get_weather", {"city": "Paris"})], ""),
        (("<|python_tag|>", LLAMA_CALL), [("get_weather", {"city": "Paris"})], ""),
        (("Sure: " + LLAMA_CALL,), [], "Sure: " + LLAMA_CALL),
        (("<|python_tag|>" + LLAMA_CALL,), [], "<|python_tag|>" + LLAMA_CALL),
    ]


@pytest.mark.slow
def test_calls_parsed_streamed_or_not(served: Served) -> None:
    """Calls come back as tool_calls; the same characters typed as text (no control token, or
    Llama's JSON after other text) stay content."""
    name, engine, client, _ = served
    if name == "gemma3":
        pytest.skip("no tool format")
    for parts, calls, content in answers(name):
        scripted(engine, *parts)
        r = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER])
        assert engine.last_params is not None and engine.last_params.shown_token_ids
        choice = r.choices[0]
        got = [
            (c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls or []
        ]
        assert got == calls and (choice.message.content or "") == content, parts
        assert choice.finish_reason == ("tool_calls" if calls else "stop")
        names: dict[int, str] = {}
        arguments: dict[int, str] = {}
        text = ""
        stream = client.chat.completions.create(
            model="m", messages=USER, tools=[WEATHER], stream=True
        )
        for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            text += (delta.content or "") if delta else ""
            for c in (delta.tool_calls or []) if delta else []:
                assert c.function is not None
                names[c.index] = names.get(c.index, "") + (c.function.name or "")
                arguments[c.index] = arguments.get(c.index, "") + (c.function.arguments or "")
        streamed = [(names[i], json.loads(arguments[i])) for i in sorted(names)]
        assert streamed == calls and text == content


@pytest.mark.slow
def test_history_and_forced_calls(served: Served) -> None:
    """A call and its result sent back are written in the family's format; a forced call is
    constrained by a grammar in the family's markup."""
    name, engine, client, _ = served
    if name == "gemma3":
        with pytest.raises(openai.BadRequestError, match="Gemma") as raised:
            client.chat.completions.create(model="m", messages=USER, tools=[WEATHER])
        assert raised.value.body is not None and "tools" in json.dumps(raised.value.body)
        return
    call = {"id": "call_0123456789abcdef", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]
    scripted(engine, "It is sunny.")
    r = client.chat.completions.create(model="m", messages=history, tools=[WEATHER])
    assert r.choices[0].message.content == "It is sunny."
    prompt = engine.tokenizer.decode(engine.last_prompt)
    if name == "mistral":
        assert (
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": ' in prompt
        )
        assert (
            '[TOOL_RESULTS] {"content": "sunny", "call_id": "789abcdef"}[/TOOL_RESULTS]' in prompt
        )
    else:
        assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in prompt
        assert '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"<|eot_id|>' in prompt
    scripted(engine, *answers(name)[0][0][1:] if name == "mistral" else (LLAMA_CALL,))
    r = client.chat.completions.create(
        model="m", messages=USER, tools=[WEATHER], tool_choice="required"
    )
    assert engine.last_params is not None and engine.last_params.structured is not None
    grammar = engine.last_params.structured.source
    if name == "mistral":
        assert f"<[{engine.tokenizer.token_to_id('[TOOL_CALLS]')}]>" in grammar
    else:
        assert '"{\\"name\\": \\"get_weather\\", \\"parameters\\": "' in grammar
    assert r.choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
def test_anthropic_tool_use(served: Served) -> None:
    """The Messages API reads the same markup: calls become tool_use blocks."""
    name, engine, _, url = served
    if name == "gemma3":
        pytest.skip("no tool format")
    parts, calls, content = answers(name)[0]
    scripted(engine, *parts)
    with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0) as claude:
        message = claude.messages.create(
            model="m",
            max_tokens=256,
            messages=USER,
            tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
        )
    uses = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    texts = "".join(b.text for b in message.content if b.type == "text")
    assert uses == calls and texts == content and message.stop_reason == "tool_use"
