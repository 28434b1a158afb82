"""The official anthropic SDK against a live server over the fake engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import pydantic
import pytest

from deepinfer.api.app import create_app
from deepinfer.text.recipe import ChatMessage
from tests.api.fake_engine import REPLY, FakeEngine
from tests.api.live_server import LiveServer

SCHEMA_A = {"type": "object", "properties": {"a": {"type": "integer"}}}
SCHEMA_B = {"type": "object", "properties": {"b": {"type": "integer"}}}


@pytest.fixture(scope="module")
def client(fake_server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=fake_server.url, api_key="x", max_retries=0) as c:
        yield c


def test_message_non_streaming(client: anthropic.Anthropic, fake_engine: FakeEngine) -> None:
    m = client.messages.create(
        model="m", max_tokens=500, system="Be brief.", messages=[{"role": "user", "content": "hi"}]
    )
    assert m.type == "message" and m.role == "assistant"
    assert m.content[0].type == "text" and m.content[0].text == REPLY
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    ids = fake_engine.recipe.encode([ChatMessage("system", "Be brief."), ChatMessage("user", "hi")])
    u = m.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) == len(ids)
    assert u.cache_creation_input_tokens == 0
    assert u.output_tokens == len(REPLY) + 1


def test_text_blocks_stop_sequence_and_max_tokens(client: anthropic.Anthropic) -> None:
    m = client.messages.create(
        model="m", max_tokens=500, system=[{"type": "text", "text": "sys"}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        stop_sequences=["fake"], extra_body={"temperature": 0.3, "top_p": 0.9, "top_k": 10},
    )  # fmt: skip
    assert m.content[0].text == REPLY[: REPLY.index("fake")]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "fake"
    m2 = client.messages.create(
        model="m", max_tokens=3, messages=[{"role": "user", "content": "x"}]
    )
    assert m2.stop_reason == "max_tokens" and m2.content[0].text == REPLY[:3]


def test_cache_read_on_repeat(client: anthropic.Anthropic) -> None:
    msgs: list[anthropic.types.MessageParam] = [{"role": "user", "content": "repeat me " * 10}]
    client.messages.create(model="m", max_tokens=2, messages=msgs)
    m = client.messages.create(model="m", max_tokens=2, messages=msgs)
    assert (m.usage.cache_read_input_tokens or 0) > 0


def test_streaming_events(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].type == "text" and final.content[0].text == REPLY[:8]
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8


def test_count_tokens(client: anthropic.Anthropic, fake_engine: FakeEngine) -> None:
    r = client.messages.count_tokens(
        model="m", system="s", messages=[{"role": "user", "content": "count <|im_end|> me"}]
    )
    ids = fake_engine.recipe.encode(
        [ChatMessage("system", "s"), ChatMessage("user", "count <|im_end|> me")]
    )
    assert r.input_tokens == len(ids)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages.0.content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "extra_body": {"temperature": 1.5}},
            "temperature",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ],
)
def test_bad_input_is_400_invalid_request_error(
    client: anthropic.Anthropic, kwargs: dict[str, object], needle: str
) -> None:
    kwargs = {"max_tokens": 10, **kwargs}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="m", **kwargs)  # type: ignore[call-overload]
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and needle in body["error"]["message"]


def test_max_tokens_required(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.post("/v1/messages", body={"model": "m", "messages": []}, cast_to=object)
    assert "max_tokens" in str(info.value.body)


def test_overload_is_529_overloaded_error() -> None:
    server = LiveServer(create_app(FakeEngine(max_active=0))).start()
    try:
        with (
            anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as c,
            pytest.raises(anthropic.OverloadedError) as info,
        ):
            c.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        assert info.value.status_code == 529
        assert info.value.response.headers["retry-after"] == "2"
        body = info.value.body
        assert isinstance(body, dict) and body["error"]["type"] == "overloaded_error"
    finally:
        server.stop()


class City(pydantic.BaseModel):
    name: str
    population: int


def test_parse_sends_output_config_format(
    client: anthropic.Anthropic, fake_engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`messages.parse(output_format=Model)` sends `output_config.format`: its schema becomes the
    request's constraint, and the answer parses into the model."""
    monkeypatch.setattr(fake_engine, "reply", '{"name": "Paris", "population": 2100000}')
    m = client.messages.parse(
        model="m", max_tokens=100, output_format=City,
        messages=[{"role": "user", "content": "A city as JSON."}],
    )  # fmt: skip
    assert m.parsed_output == City(name="Paris", population=2100000)
    spec = fake_engine.last_params.structured if fake_engine.last_params else None
    assert spec is not None and spec.param == "output_config.format.schema"
    schema = json.loads(spec.source)
    assert schema["required"] == ["name", "population"]
    assert schema["properties"]["population"]["type"] == "integer"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (
            {
                "output_config": {"format": {"type": "json_schema", "schema": SCHEMA_A}},
                "output_format": {"type": "json_schema", "schema": SCHEMA_B},
            },
            "output_config.format: differs from output_format",
        ),
        ({"output_config": {"format": {"type": "text"}}}, "output_config.format.type"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
        ({"output_config": {"effort": "max"}}, "output_config.effort"),
    ],
)
def test_output_config_errors_name_the_field(
    client: anthropic.Anthropic, body: dict[str, object], needle: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model="m", max_tokens=10, messages=[{"role": "user", "content": "x"}], extra_body=body
        )
    error = info.value.body
    assert isinstance(error, dict) and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(needle)


def test_output_config_and_output_format_may_agree(
    client: anthropic.Anthropic, fake_engine: FakeEngine
) -> None:
    fmt = {"type": "json_schema", "schema": SCHEMA_A}
    client.messages.create(
        model="m", max_tokens=2, messages=[{"role": "user", "content": "x"}],
        output_config={"format": fmt}, extra_body={"output_format": fmt},  # type: ignore[typeddict-item]
    )  # fmt: skip
    spec = fake_engine.last_params.structured if fake_engine.last_params else None
    assert spec is not None and json.loads(spec.source) == SCHEMA_A


def test_output_config_effort_is_a_reasoning_effort(
    client: anthropic.Anthropic, fake_engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`output_config.effort` reaches the recipe as OpenAI's `reasoning_effort` does, in
    count_tokens too."""
    efforts: list[object] = []
    encode = fake_engine.recipe.encode

    def recording(messages: Any, **kwargs: Any) -> list[int]:
        efforts.append(kwargs.get("reasoning_effort"))
        return encode(messages, **kwargs)

    monkeypatch.setattr(fake_engine.recipe, "encode", recording)
    messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hi"}]
    client.messages.count_tokens(model="m", messages=messages, output_config={"effort": "high"})
    client.messages.create(
        model="m", max_tokens=2, messages=messages, output_config={"effort": "low"}
    )
    client.messages.create(model="m", max_tokens=2, messages=messages)
    assert efforts == ["high", "low", None]


@pytest.mark.slow
def test_parse_on_the_real_model(real_server: LiveServer) -> None:
    """SmolLM2 through `messages.parse`: the constrained answer validates as the model."""
    with anthropic.Anthropic(base_url=real_server.url, api_key="x", max_retries=0) as c:
        m = c.messages.parse(
            model="m", max_tokens=60, output_format=City, extra_body={"temperature": 0.0},
            messages=[{"role": "user", "content": "Name a big city and its population."}],
        )  # fmt: skip
    assert m.stop_reason == "end_turn", m.content
    assert isinstance(m.parsed_output, City)
    City.model_validate_json(m.content[0].text)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("history", "needle"),
    [
        ([], "messages.0.content[0].tool_use_id: unexpected tool_use_id 'toolu_9'"),
        (
            [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {}}]},
            ],
            "messages.2.content[0].tool_use_id: unexpected tool_use_id 'toolu_9'",
        ),
    ],
)  # fmt: skip
def test_tool_result_of_an_undeclared_tool_use_is_400(
    client: anthropic.Anthropic, history: list[Any], needle: str
) -> None:
    """A tool_result must answer a tool_use of an earlier assistant turn, as Anthropic checks;
    answering a declared one is accepted."""
    result = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "21 C"}]}  # fmt: skip
    for count in (False, True):
        with pytest.raises(anthropic.BadRequestError) as info:
            if count:
                client.messages.count_tokens(model="m", messages=[*history, result])
            else:
                client.messages.create(model="m", max_tokens=2, messages=[*history, result])
        body = info.value.body
        assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith(needle)
    if history:
        answered = {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"}]}  # fmt: skip
        m = client.messages.create(model="m", max_tokens=2, messages=[*history, answered])
        assert m.stop_reason == "max_tokens"
