"""No accepted field is silently ignored: each field the server does not honour is a 400 naming
it (in the API's own envelope) when set to a value that would need honouring, and accepted at
its default; the cheap ones are honoured (continuous usage, Anthropic top_k, stop_sequences,
metadata.user_id)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pytest

from deepinfer.api.anthropic.schemas import AnthropicRefusedFields
from deepinfer.api.openai.schemas import OpenAIRefusedFields
from deepinfer.request import SamplingParams
from tests.api.fake_engine import REPLY, FakeEngine
from tests.api.live_server import LiveServer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 3}
MESSAGES = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

OPENAI_REFUSED: list[tuple[str, Any, Any]] = [
    ("best_of", 2, 1),
    ("use_beam_search", True, False),
    ("length_penalty", 0.5, 1.0),
    ("skip_special_tokens", False, True),
    ("spaces_between_special_tokens", False, True),
    ("truncate_prompt_tokens", 8, None),
    ("service_tier", "flex", "auto"),
    ("store", True, False),
    ("modalities", ["text", "audio"], ["text"]),
    ("audio", {"voice": "alloy", "format": "wav"}, None),
    ("web_search_options", {}, None),
    ("functions", [{"name": "f", "parameters": {}}], []),
    ("function_call", "auto", None),
    ("verbosity", "low", "medium"),
    ("chat_template", "{{ messages }}", None),
    ("moderation", {"model": "omni-moderation-latest"}, None),
    ("prompt_cache_options", {"mode": "auto"}, None),
]
COMPLETION_REFUSED: list[tuple[str, Any, Any]] = [
    # honoured by chat (api/prompt_options.py); a completion prompt has no chat turns
    ("prediction", {"type": "content", "content": "x"}, None),
    ("add_generation_prompt", False, True),
    ("continue_final_message", True, False),
    ("chat_template_kwargs", {"enable_thinking": True}, None),
]

ANTHROPIC_REFUSED: list[tuple[str, Any, Any]] = [
    ("service_tier", "priority", "auto"),
    ("container", "container_1", None),
    ("mcp_servers", [{"type": "url", "url": "https://x", "name": "x"}], []),
    ("context_management", {"edits": []}, None),
    ("diagnostics", {"previous_message_id": "msg_1"}, None),
    ("inference_geo", "us", None),
    ("speed", "fast", "standard"),
]


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


@pytest.mark.parametrize(
    ("path", "field", "refused", "default"),
    [
        *(
            (p, *case)
            for p in ("/v1/chat/completions", "/v1/completions")
            for case in OPENAI_REFUSED
        ),
        *(("/v1/completions", *case) for case in COMPLETION_REFUSED),
    ],
)
def test_openai_refused_field(
    fake_server: LiveServer, path: str, field: str, refused: Any, default: Any
) -> None:
    base = CHAT if path == "/v1/chat/completions" else COMPLETION
    r = post(fake_server, path, {**base, field: refused})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"]
    assert error["type"] == "invalid_request_error"
    assert post(fake_server, path, {**base, field: default}).status_code == 200


def test_every_refused_field_is_tried() -> None:
    """Each field declared as refused is sent by the tests above (by its wire name)."""
    for struct, tried in [
        (OpenAIRefusedFields, OPENAI_REFUSED + COMPLETION_REFUSED),
        (AnthropicRefusedFields, ANTHROPIC_REFUSED),
    ]:
        declared = {f.encode_name for f in msgspec.structs.fields(struct)}
        assert declared == {field for field, _, _ in tried}, struct.__name__


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize(("field", "refused", "default"), ANTHROPIC_REFUSED)
def test_anthropic_refused_field(
    fake_server: LiveServer, path: str, field: str, refused: Any, default: Any
) -> None:
    base = MESSAGES if path == "/v1/messages" else {"messages": MESSAGES["messages"]}
    r = post(fake_server, path, {**base, field: refused})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(field)
    assert post(fake_server, path, {**base, field: default}).status_code == 200


def test_anthropic_metadata_user_id_only(fake_server: LiveServer) -> None:
    ok = post(fake_server, "/v1/messages", {**MESSAGES, "metadata": {"user_id": "u-1"}})
    assert ok.status_code == 200
    r = post(fake_server, "/v1/messages", {**MESSAGES, "metadata": {"tenant": "t"}})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("metadata.tenant")


@pytest.fixture
def submitted(fake_engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The SamplingParams of every request the engine receives."""
    seen: list[SamplingParams] = []
    submit = fake_engine.submit

    async def recording(prompt: Any, params: SamplingParams, **kwargs: Any) -> Any:
        seen.append(params)
        return await submit(prompt, params, **kwargs)

    monkeypatch.setattr(fake_engine, "submit", recording)
    yield seen


def test_anthropic_top_k_and_stop_sequences(fake_server: LiveServer, submitted: list[Any]) -> None:
    with anthropic.Anthropic(base_url=fake_server.url, api_key="x", max_retries=0) as c:
        m = c.messages.create(
            model="m", max_tokens=200, stop_sequences=["fake"], extra_body={"top_k": 7},
            messages=[{"role": "user", "content": "hi"}],
        )  # fmt: skip
    assert submitted[-1].top_k == 7 and submitted[-1].stop == ("fake",)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "fake"
    assert m.content[0].type == "text" and m.content[0].text == REPLY[: REPLY.index("fake")]


def test_responses_sampling_reaches_the_engine(
    fake_server: LiveServer, submitted: list[Any]
) -> None:
    with openai.OpenAI(base_url=fake_server.url + "/v1", api_key="x", max_retries=0) as c:
        c.responses.create(model="m", input="x", temperature=0.25, top_p=0.5, max_output_tokens=4)
    p = submitted[-1]
    assert (p.temperature, p.top_p, p.max_tokens) == (0.25, 0.5, 4)


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_continuous_usage_stats(fake_server: LiveServer, include_usage: bool) -> None:
    with openai.OpenAI(base_url=fake_server.url + "/v1", api_key="x", max_retries=0) as c:
        chunks = list(
            c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                stream=True,
                stream_options={"include_usage": include_usage, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            )
        )  # fmt: skip
    with_choices = [ch for ch in chunks if ch.choices]
    assert all(ch.usage is not None for ch in chunks)
    completions = [ch.usage.completion_tokens for ch in with_choices if ch.usage]
    assert completions[0] == 0 and completions[-1] == 6
    assert completions == sorted(completions)
    assert len(chunks) == len(with_choices) + include_usage


def test_completion_continuous_usage_stats(fake_server: LiveServer) -> None:
    body = {**COMPLETION, "max_tokens": 5, "stream": True}
    body["stream_options"] = {"continuous_usage_stats": True}
    with httpx.stream("POST", fake_server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    usages = [json.loads(line[6:])["usage"] for line in lines]
    assert all(u is not None for u in usages)
    assert usages[-1]["completion_tokens"] == 5
    assert all(u["prompt_tokens"] == usages[0]["prompt_tokens"] for u in usages)
