"""Token utilities: /tokenize and /detokenize against the engine's own tokenizer and recipe (fake
engine; SmolLM2 when slow), and GET /v1/models/{id}."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from deepinfer.text.recipe import ChatMessage
from tests.api.live_server import LiveServer

TEXT = "Hello <|im_end|> wörld 🌍!"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def engine_of(server: LiveServer) -> Any:
    return server.config.app.state.engine


def check_round_trip(server: LiveServer) -> None:
    engine = engine_of(server)
    r = post(server, "/tokenize", {"prompt": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == engine.recipe.encode_prompt(TEXT)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == engine.max_model_len
    bare = post(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    assert bare["tokens"] == engine.tokenizer.encode(TEXT)
    back = post(server, "/detokenize", {"tokens": bare["tokens"]}).json()
    assert back == {"prompt": TEXT}


def check_chat(server: LiveServer) -> None:
    engine = engine_of(server)
    messages = [ChatMessage(m["role"], m["content"]) for m in MESSAGES]
    for gen in (True, False):
        r = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": gen})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == engine.recipe.encode(messages, add_generation_prompt=gen)
    prefill = [*MESSAGES, {"role": "assistant", "content": "Sure"}]
    body = {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True}
    r = post(server, "/tokenize", {**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    continued = [*messages, ChatMessage("assistant", "Sure")]
    expected = engine.recipe.encode(
        continued, add_generation_prompt=False, continue_final_message=True, enable_thinking=False
    )
    assert r.json()["tokens"] == expected


def check_chat_with_tools(server: LiveServer) -> None:
    """Messages and tools count as many tokens as chat completions' prompt of the same request,
    and the tools are in them."""
    plain = post(server, "/tokenize", {"messages": MESSAGES}).json()["count"]
    r = post(server, "/tokenize", {"messages": MESSAGES, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    body = {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 1}
    chat = post(server, "/v1/chat/completions", body).json()
    assert r.json()["count"] == chat["usage"]["prompt_tokens"] > plain
    text = post(server, "/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"]
    assert "get_weather" in text and "Weather of a city." in text


def test_round_trip(fake_server: LiveServer) -> None:
    check_round_trip(fake_server)


def test_chat_messages_through_the_recipe(fake_server: LiveServer) -> None:
    check_chat(fake_server)


def test_chat_with_tools(fake_server: LiveServer) -> None:
    check_chat_with_tools(fake_server)


def test_token_strs(fake_server: LiveServer) -> None:
    body = post(fake_server, "/tokenize", {"prompt": "ab", "return_token_strs": True}).json()
    assert body["token_strs"] == ["a", "b"]


def test_render_gives_the_ids_a_request_runs(fake_server: LiveServer) -> None:
    """vLLM's render endpoints: a chat's ids are /tokenize's for the same messages and tools and
    as many as the chat completion's prompt; each completion prompt is rendered alone."""
    engine = engine_of(fake_server)
    body = {"model": "m", "messages": MESSAGES, "tools": [WEATHER], "max_tokens": 3,
            "temperature": 0.5, "stop": "x", "stream": True}  # fmt: skip
    r = post(fake_server, "/v1/chat/completions/render", body)
    assert r.status_code == 200, r.text
    rendered = r.json()
    tokenized = post(fake_server, "/tokenize", {"messages": MESSAGES, "tools": [WEATHER]}).json()
    assert rendered["token_ids"] == tokenized["tokens"]
    assert rendered["sampling_params"] == {"max_tokens": 3, "temperature": 0.5, "stop": ["x"]}
    assert rendered["model"] == "m" and rendered["stream"] is True
    chat = post(fake_server, "/v1/chat/completions", {**body, "stream": False}).json()
    assert chat["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    r = post(fake_server, "/v1/completions/render", {"prompt": ["ab", TEXT], "n": 2})
    assert r.status_code == 200, r.text
    assert [one["token_ids"] for one in r.json()] == [
        engine.recipe.encode_prompt("ab"),
        engine.recipe.encode_prompt(TEXT),
    ]
    assert r.json()[0]["sampling_params"] == {"max_tokens": 16, "n": 2}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "messages"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ("/tokenize", {"prompt": "a", "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tools_in_user": True}}, "chat_template_kwargs.tools_in_user"),
        ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{x}}"}, "chat_template"),
        ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0].type"),
        ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "x", "function": {"name": "f"}}]}, "tools[0].type"),
        ("/tokenize", {"prompt": "a", "tools": [WEATHER]}, "tools"),
        ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"messages": [{"role": "critic", "content": "x"}]}, "messages[0].role"),
        ("/detokenize", {"tokens": [5, -1]}, "tokens[1]"),
        ("/detokenize", {"tokens": [2**40]}, "tokens[0]"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/v1/chat/completions/render", {"messages": MESSAGES, "n": 0}, "n"),
        ("/v1/chat/completions/render", {"messages": [{"role": "critic", "content": "x"}]}, "messages[0].role"),
        ("/v1/completions/render", {"prompt": []}, "prompt"),
        ("/v1/completions/render", {"prompt": "a", "suffix": "b"}, "suffix"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(
    fake_server: LiveServer, path: str, body: dict[str, Any], param: str
) -> None:
    r = post(fake_server, path, body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_model_by_id(fake_server: LiveServer) -> None:
    with openai.OpenAI(base_url=fake_server.url + "/v1", api_key="x", max_retries=0) as c:
        model = c.models.retrieve("fake-model")
        assert model.id == "fake-model" and model.object == "model"
        with pytest.raises(openai.NotFoundError) as info:
            c.models.retrieve("other/model")
    body: Any = info.value.body
    assert body["code"] == "model_not_found" and body["type"] == "not_found_error"


@pytest.mark.slow
def test_real_tokenizer(real_server: LiveServer) -> None:
    check_round_trip(real_server)
    check_chat(real_server)
    check_chat_with_tools(real_server)
