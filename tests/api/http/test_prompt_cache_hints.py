"""OpenAI's session hints through the openai SDK against the live server: `prompt_cache_key` is
echoed in the `x-prompt-cache-key` header (for routers' sticky sessions) on chat completions,
completions and Responses, streamed or not; `prompt_cache_retention` maps onto the retention
classes the engine receives; bad values are a 400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.api.fake_engine import FakeEngine
from tests.api.live_server import LiveServer

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[FakeEngine, openai.OpenAI]]:
    from deepinfer.api.app import create_app

    engine = FakeEngine()
    server = LiveServer(create_app(engine)).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    try:
        yield engine, client
    finally:
        client.close()
        server.stop()


@pytest.mark.parametrize(("retention", "expected"), [("in_memory", "none"), ("24h", "agent")])
def test_chat_key_is_echoed_and_retention_mapped(
    served: tuple[FakeEngine, openai.OpenAI], retention: str, expected: str
) -> None:
    engine, client = served
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, max_tokens=3,  # type: ignore[arg-type]
        prompt_cache_key="session-42", prompt_cache_retention=retention,  # type: ignore[arg-type]
    )  # fmt: skip
    assert raw.headers["x-prompt-cache-key"] == "session-42"
    assert raw.parse().choices[0].message.content
    assert engine.last_cache_retention == expected


def test_streams_completions_and_responses_echo_the_key(
    served: tuple[FakeEngine, openai.OpenAI],
) -> None:
    engine, client = served
    with client.chat.completions.with_streaming_response.create(
        model="m", messages=MESSAGES, max_tokens=3, stream=True,  # type: ignore[arg-type]
        prompt_cache_key="user/ü 1",
    ) as stream:  # fmt: skip
        assert stream.headers["x-prompt-cache-key"] == "user/%C3%BC%201"
        assert list(stream.iter_lines())
    raw = client.completions.with_raw_response.create(
        model="m", prompt="hi", max_tokens=3,
        extra_body={"prompt_cache_key": "c", "prompt_cache_retention": "24h"},
    )  # fmt: skip
    assert raw.headers["x-prompt-cache-key"] == "c"
    assert engine.last_cache_retention == "agent"
    resp = client.responses.with_raw_response.create(
        model="m", input="hi", prompt_cache_key="r", prompt_cache_retention="in_memory"
    )
    assert resp.headers["x-prompt-cache-key"] == "r"
    assert resp.parse().output_text
    assert engine.last_cache_retention == "none"


def test_without_a_key_no_header_and_the_default_retention(
    served: tuple[FakeEngine, openai.OpenAI],
) -> None:
    engine, client = served
    raw = client.chat.completions.with_raw_response.create(
        model="m",
        messages=MESSAGES,
        max_tokens=3,  # type: ignore[arg-type]
    )
    assert "x-prompt-cache-key" not in raw.headers
    assert engine.last_cache_retention is None
    # deepinfer's own field wins over OpenAI's
    client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=3, prompt_cache_retention="24h",  # type: ignore[arg-type]
        extra_body={"cache_retention": "chat"},
    )  # fmt: skip
    assert engine.last_cache_retention == "chat"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt_cache_retention": "7d"}, "prompt_cache_retention"),
        ({"prompt_cache_key": "k" * 1025}, "prompt_cache_key"),
    ],
)
def test_bad_hints_are_refused_by_name(
    served: tuple[FakeEngine, openai.OpenAI], body: dict[str, str], param: str
) -> None:
    _, client = served
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            max_tokens=3,
            extra_body=body,  # type: ignore[arg-type]
        )
    assert err.value.param == param
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="m", input="hi", extra_body=body)
    assert err.value.param == param
