"""The official anthropic SDK against a live server over the fake engine."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest

from deepinfer.api.app import create_app
from deepinfer.text.recipe import ChatMessage
from tests.api.fake_engine import REPLY, FakeEngine
from tests.api.live_server import LiveServer


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
