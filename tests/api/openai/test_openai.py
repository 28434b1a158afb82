"""The official openai SDK against a live server over the fake engine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from deepinfer.api.app import create_app
from tests.api.fake_engine import REPLY, FakeEngine
from tests.api.live_server import LiveServer


@pytest.fixture(scope="module")
def client(fake_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=fake_server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def test_chat_non_streaming(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    r = client.chat.completions.create(model="fake-model", messages=user("hi"), max_tokens=500)
    assert r.object == "chat.completion"
    assert r.choices[0].message.content == REPLY
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop"
    prompt_ids = fake_engine.recipe.encode([_msg("user", "hi")])
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == len(REPLY) + 1  # the end-of-turn token
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize(
    ("prediction", "text"),
    [
        ({"type": "content", "content": "def f():\n    return 1\n"}, "def f():\n    return 1\n"),
        (
            {
                "type": "content",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            "ab",
        ),
        ({"type": "content", "content": ""}, None),
        (None, None),
    ],
)
def test_chat_prediction_reaches_the_engine_as_text(
    client: openai.OpenAI, fake_engine: FakeEngine, prediction: Any, text: str | None
) -> None:
    """Predicted Outputs: the SDK's `prediction` is handed to the engine as its text (parts
    joined); an empty one or none is no prediction, and the usage then has no
    `completion_tokens_details`."""
    r = client.chat.completions.create(model="m", messages=user("hi"), prediction=prediction)
    assert fake_engine.last_prediction == text
    assert r.choices[0].message.content == REPLY
    assert r.usage is not None and r.usage.completion_tokens_details is None


def _msg(role: str, content: str):  # type: ignore[no-untyped-def]
    from deepinfer.text.recipe import ChatMessage

    return ChatMessage(role, content)


def test_chat_length_and_cached_tokens_on_repeat(client: openai.OpenAI) -> None:
    text = "a long enough prompt to fill several blocks " * 3
    first = client.chat.completions.create(model="m", messages=user(text), max_completion_tokens=5)
    assert first.choices[0].finish_reason == "length"
    assert first.choices[0].message.content == REPLY[:5]
    second = client.chat.completions.create(model="m", messages=user(text), max_tokens=5)
    assert first.usage and second.usage and second.usage.prompt_tokens_details
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens


def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="m", messages=user("hi"), max_tokens=10, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY[:10]
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens_details is not None
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_n_logprobs_stop(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="m", messages=user("hi"), n=2, stop=["fake"], logprobs=True, top_logprobs=2,
        seed=3, temperature=0.5, top_p=0.9, presence_penalty=0.1, frequency_penalty=0.1,
        extra_body={"top_k": 5, "min_tokens": 1, "repetition_penalty": 1.1, "ignore_eos": False},
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.message.content == REPLY[: REPLY.index("fake")]
        assert c.finish_reason == "stop"
        assert c.logprobs is not None and c.logprobs.content is not None
        first = c.logprobs.content[0]
        assert first.token == REPLY[0] and first.logprob == -0.5
        assert [t.logprob for t in first.top_logprobs] == [-0.5, -1.5]
    assert r.usage is not None
    assert r.usage.completion_tokens == 2 * (REPLY.index("fake") + 1)


def test_ignore_eos_generates_max_tokens(client: openai.OpenAI) -> None:
    n = len(REPLY) + 7
    r = client.chat.completions.create(
        model="m", messages=user("x"), max_tokens=n, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == n


def test_completions_text_and_ids(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    r = client.completions.create(model="m", prompt="Once upon", max_tokens=4, logprobs=1)
    assert r.object == "text_completion"
    assert r.choices[0].text == REPLY[:4]
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].logprobs is not None
    assert r.choices[0].logprobs.tokens == list(REPLY[:4])
    assert r.choices[0].logprobs.text_offset == [0, 1, 2, 3]
    assert r.usage is not None and r.usage.prompt_tokens == len("Once upon")
    ids = fake_engine.tokenizer.encode("abc")
    r2 = client.completions.create(model="m", prompt=ids, max_tokens=2)
    assert r2.usage is not None and r2.usage.prompt_tokens == 3
    r3 = client.completions.create(model="m", prompt=["ab", "cde"], max_tokens=2, n=2)
    assert [c.index for c in r3.choices] == [0, 1, 2, 3]
    assert r3.usage is not None and r3.usage.prompt_tokens == 5
    assert r3.usage.completion_tokens == 8


def test_completions_streaming(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model="m",
            prompt="Hi",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == REPLY[:6]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": user("x"), "max_tokens": "ten"}, "max_tokens"),
        ({"messages": user("x"), "max_tokens": 0}, "max_tokens"),
        ({"messages": user("x"), "temperature": -1}, "temperature"),
        ({"messages": user("x"), "top_p": 2}, "top_p"),
        ({"messages": user("x"), "n": 99}, "n"),
        ({"messages": user("x"), "logprobs": True, "top_logprobs": 50}, "logprobs"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": user("x"), "max_tokens": 100_000}, "max_tokens"),
        (
            {"messages": user("x"), "prediction": {"type": "diff", "content": "x"}},
            "prediction.type",
        ),
        ({"messages": user("x"), "prediction": {"type": "content"}}, "prediction"),
        ({"messages": user("x"), "prediction": "def f(): pass"}, "prediction"),
        (
            {
                "messages": user("x"),
                "prediction": {"type": "content", "content": [{"type": "image_url"}]},
            },
            "prediction.content[0]",
        ),
    ],
)
def test_chat_bad_input_is_400_naming_the_field(
    client: openai.OpenAI, kwargs: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", **kwargs)  # type: ignore[call-overload]
    assert info.value.status_code == 400
    body = info.value.body
    assert (
        isinstance(body, dict)
        and body["param"] == param
        and body["type"] == "invalid_request_error"
    )
    assert param in body["message"]


def test_context_length_error_reports_counts(
    client: openai.OpenAI, fake_engine: FakeEngine
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="abc", max_tokens=fake_engine.max_model_len)
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded"
    assert f"3 prompt + {fake_engine.max_model_len} max_tokens" in body["message"]


def test_malformed_json_and_bad_prompts(fake_server: LiveServer) -> None:
    for path, body in [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", b""),
        ("/v1/chat/completions", b"[1, 2]"),
        ("/v1/completions", b'{"prompt": []}'),
        ("/v1/completions", b'{"prompt": [1, "a"]}'),
        ("/v1/completions", b'{"prompt": [-5]}'),
        ("/v1/completions", b'{"prompt": ""}'),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}'),
    ]:
        r = httpx.post(
            fake_server.url + path, content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_overload_is_429_with_retry_after() -> None:
    engine = FakeEngine(max_active=0)
    server = LiveServer(create_app(engine)).start()
    try:
        with (
            openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c,
            pytest.raises(openai.RateLimitError) as info,
        ):
            c.chat.completions.create(model="m", messages=user("x"))
        assert info.value.response.headers["retry-after"] == "2"
    finally:
        server.stop()
