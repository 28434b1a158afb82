"""The Responses API through the official openai SDK: over the fake engine for the wire shapes,
and over SmolLM2 (slow) for a conversation continued from the prefix cache."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from deepinfer.api.app import create_app
from deepinfer.api.responses.store import ResponseStore
from deepinfer.errors import ConfigError
from deepinfer.server_config import ServerConfig, StoredResponseLimits
from deepinfer.text.recipe import ChatMessage
from tests.api.fake_engine import REPLY, FakeEngine
from tests.api.live_server import LiveServer

OPENING = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
CLOSING = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def client(fake_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=fake_server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def prompt_len(engine: FakeEngine, *messages: tuple[str, str]) -> int:
    return len(engine.recipe.encode([ChatMessage(r, c) for r, c in messages]))


def test_create_non_streamed(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    r = client.responses.create(
        model="fake-model", input="hi", instructions="Be brief.", metadata={"k": "v"}
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "completed" and r.output_text == REPLY
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.metadata == {"k": "v"} and r.instructions == "Be brief."
    assert r.usage is not None
    assert r.usage.input_tokens == prompt_len(fake_engine, ("system", "Be brief."), ("user", "hi"))
    assert r.usage.output_tokens == len(REPLY) + 1  # the end-of-turn token
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0


def test_items_input_and_length(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    items: Any = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {"role": "user", "content": "c"},
    ]
    r = client.responses.create(model="m", input=items, max_output_tokens=5)
    assert r.status == "incomplete" and r.output_text == REPLY[:5]
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    expected = prompt_len(
        fake_engine, ("system", "Rules."), ("user", "a"), ("assistant", "b"), ("user", "c")
    )
    assert r.usage is not None and r.usage.input_tokens == expected


def test_stream_accumulates(client: openai.OpenAI) -> None:
    with client.responses.stream(model="m", input="hi") as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == OPENING and types[-4:] == [*CLOSING, "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == REPLY == final.output_text
    assert final.status == "completed" and final.usage is not None
    assert final.usage.output_tokens == len(REPLY) + 1


def test_stream_raw_incomplete(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="m", input="hi", stream=True, max_output_tokens=3))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details is not None
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == REPLY[:3]


def test_previous_response_id_continues(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    first = client.responses.create(model="m", input="tell me a story about blocks")
    second = client.responses.create(model="m", input="more", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    conversation = [("user", "tell me a story about blocks"), ("assistant", REPLY)]
    first_ids = fake_engine.recipe.encode([ChatMessage(r, c) for r, c in conversation[:1]])
    full = [*conversation, ("user", "more")]
    second_ids = fake_engine.recipe.encode([ChatMessage(r, c) for r, c in full])
    assert second_ids[: len(first_ids)] == first_ids  # the first prompt is a prefix
    assert second.usage is not None and second.usage.input_tokens == len(second_ids)
    block = fake_engine.block_size
    assert second.usage.input_tokens_details.cached_tokens == len(first_ids) // block * block
    third = client.responses.create(model="m", input="end", previous_response_id=second.id)
    assert third.usage is not None
    assert third.usage.input_tokens == prompt_len(
        fake_engine, *full, ("assistant", REPLY), ("user", "end")
    )


def test_streamed_response_is_stored(client: openai.OpenAI) -> None:
    with client.responses.stream(model="m", input="x") as stream:
        first = stream.get_final_response()
    second = client.responses.create(model="m", input="y", previous_response_id=first.id)
    assert second.status == "completed"


def test_unknown_or_unstored_previous_id_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="m", input="x", previous_response_id="resp_missing")
    body: Any = info.value.body
    assert body["param"] == "previous_response_id"
    assert body["code"] == "previous_response_not_found"
    unstored = client.responses.create(model="m", input="x", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="x", previous_response_id=unstored.id)
    kept_none = client.responses.create(
        model="m", input="x", extra_body={"cache_retention": "none"}
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="x", previous_response_id=kept_none.id)


def test_previous_id_is_per_tenant(client: openai.OpenAI) -> None:
    mine = client.responses.create(model="m", input="x", extra_body={"cache_salt": "a"})
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="y", previous_response_id=mine.id)
    ok = client.responses.create(
        model="m", input="y", previous_response_id=mine.id, extra_body={"cache_salt": "a"}
    )
    assert ok.status == "completed"


def test_unknown_fields_accepted_informational_fields_too(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="m", input="x", user="u", safety_identifier="s", prompt_cache_key="k",
        truncation="disabled", service_tier="auto", parallel_tool_calls=True, tool_choice="auto",
        text={"format": {"type": "text"}}, reasoning={"effort": "low"},
        extra_body={"some_future_field": {"a": 1}},
    )  # fmt: skip
    assert r.status == "completed"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "frobnicate"}}],
          "tool_choice": "required"}, "tools[0].parameters"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function",
          "name": "g"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice.type"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format.schema"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"truncation": "auto"}, "truncation"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
        ({"reasoning": {"effort": "minimal"}}, "reasoning.effort"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"max_tool_calls": 3}, "max_tool_calls"),
        ({"stream_options": {"include_obfuscation": True}, "stream": True}, "stream_options.include_obfuscation"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
        ({"temperature": -1.0}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]}, "input[0].arguments"),
        ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0].type"),
        ({"input": [{"role": "critic", "content": "x"}]}, "input[0].role"),
    ],
)  # fmt: skip
def test_refused_fields_are_400_naming_them(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str
) -> None:
    kwargs = {"input": "x", **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", **kwargs)
    body: Any = info.value.body
    assert body["param"] == param and body["type"] == "invalid_request_error"
    assert param in body["message"]


def test_error_envelope_on_the_wire(fake_server: LiveServer) -> None:
    response = httpx.post(fake_server.url + "/v1/responses", json={"input": 3}, timeout=10)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "input"


def test_store_is_bounded_lru_and_expires() -> None:
    now = [0.0]
    limits = StoredResponseLimits(max_stored_responses=2, max_stored_chars=8)
    store = ResponseStore({"chat": 10.0}, "chat", limits=limits, clock=lambda: now[0])
    msg = (ChatMessage("user", "abc"),)
    assert store.put("a", msg, salt=None, retention=None)
    assert store.put("b", msg, salt=None, retention="chat")
    assert store.get("a", None) is not None  # a is now the most recent
    assert store.put("c", msg, salt=None, retention=None)  # evicts b (count and chars)
    store.check_integrity()
    assert store.get("b", None) is None and store.get("a", None) is not None
    assert not store.put("d", msg, salt=None, retention="none")
    assert not store.put("e", (ChatMessage("user", "x" * 9),), salt=None, retention=None)
    now[0] = 10.0
    assert store.get("a", None) is None and store.get("c", None) is None
    store.check_integrity()
    assert len(store) == 0


def test_a_tenant_past_its_quota_drops_only_its_own_responses() -> None:
    limits = StoredResponseLimits(
        max_stored_responses=6,
        max_stored_chars=60,
        max_stored_responses_per_tenant=3,
        max_stored_chars_per_tenant=12,
    )
    store = ResponseStore({"chat": 10.0}, "chat", limits=limits)
    msg = (ChatMessage("user", "abc"),)
    assert store.put("v1", msg, salt="victim", retention=None)
    assert store.put("v2", msg, salt=None, retention=None)
    for i in range(50):
        assert store.put(f"a{i}", msg, salt="attacker", retention=None)
        store.check_integrity()
    assert store.get("v1", "victim") is not None and store.get("v2", None) is not None
    assert [i for i in range(50) if store.get(f"a{i}", "attacker")] == [47, 48, 49]
    # 3 + 3 + 3 + 7 characters: its two least recently used go, to fit 12.
    assert store.put("a-big", (ChatMessage("user", "x" * 7),), salt="attacker", retention=None)
    assert store.num_stored("attacker") == 2 and store.get("a49", "attacker") is not None
    assert not store.put(
        "a-huge", (ChatMessage("user", "x" * 13),), salt="attacker", retention=None
    )
    store.check_integrity()
    assert store.get("v1", "victim") is not None and store.num_stored("victim") == 1
    for t in range(6):  # the global bound still holds, over all tenants (LRU)
        assert store.put(f"t{t}", msg, salt=f"tenant-{t}", retention=None)
        store.check_integrity()
    assert len(store) == 6 and store.get("v1", "victim") is None


def test_store_bounds_below_one_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="max_stored_responses_per_tenant must be at least 1"):
        StoredResponseLimits(max_stored_responses_per_tenant=0)


@pytest.mark.slow
def test_a_long_chain_keeps_other_tenants_responses() -> None:
    """With an API key, tenants are told apart by `cache_salt`: a chain of one past its quota
    loses its own oldest responses, never another tenant's."""
    stored = StoredResponseLimits(max_stored_responses=8, max_stored_responses_per_tenant=2)
    config = ServerConfig(api_key="k", stored_responses=stored)
    server = LiveServer(create_app(FakeEngine(), config)).start()
    victim = {"cache_salt": "victim"}
    chain = {"cache_salt": "chain"}
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0) as c:
            kept = c.responses.create(model="m", input="mine", extra_body=victim)
            ids: list[str] = []
            for i in range(10):
                previous = ids[-1] if ids else None
                r = c.responses.create(
                    model="m", input=f"turn {i}", previous_response_id=previous, extra_body=chain
                )
                ids.append(r.id)
            again = c.responses.create(
                model="m", input="again", previous_response_id=kept.id, extra_body=victim
            )
            assert again.status == "completed"
            c.responses.create(model="m", input="x", previous_response_id=ids[-2], extra_body=chain)
            with pytest.raises(openai.NotFoundError):
                c.responses.create(
                    model="m", input="x", previous_response_id=ids[-3], extra_body=chain
                )
    finally:
        server.stop()


@pytest.mark.slow
def test_real_conversation_reuses_the_first_prompt(real_server: LiveServer) -> None:
    with openai.OpenAI(base_url=real_server.url + "/v1", api_key="x", max_retries=0) as c:
        instructions = "You are a helpful assistant who answers in one short sentence."
        first = c.responses.create(
            model="m", instructions=instructions, input="What is the capital of France?",
            max_output_tokens=24, temperature=0.0,
        )  # fmt: skip
        assert "Paris" in first.output_text
        with c.responses.stream(
            model="m", instructions=instructions, input="And of Italy?",
            previous_response_id=first.id, max_output_tokens=24, temperature=0.0,
        ) as stream:  # fmt: skip
            second = stream.get_final_response()
    assert first.usage is not None and second.usage is not None
    turns = [
        {"role": "system", "content": instructions},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    ids_first = _tokenize(real_server, turns)
    turns += [
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Italy?"},
    ]
    ids_second = _tokenize(real_server, turns)
    assert first.usage.input_tokens == len(ids_first)
    assert second.usage.input_tokens == len(ids_second)
    assert ids_second[: len(ids_first)] == ids_first
    assert second.usage.input_tokens_details.cached_tokens >= len(ids_first) // 16 * 16
    assert "Rome" in second.output_text


def _tokenize(server: LiveServer, messages: list[dict[str, str]]) -> list[int]:
    response = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30)
    assert response.status_code == 200, response.text
    ids: list[int] = response.json()["tokens"]
    return ids


def test_retrieve_and_delete_a_stored_response(client: openai.OpenAI) -> None:
    """`responses.retrieve` gets the response object as created (stored by default, streamed or
    not); `store: false`, another tenant's, unknown and deleted ids are 404s in OpenAI's
    envelope."""
    created = client.responses.create(model="m", input="hi", metadata={"k": "v"})
    got = client.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump()
    assert got.output_text == REPLY and got.status == "completed"
    with client.responses.stream(model="m", input="hi") as stream:
        streamed = stream.get_final_response()
    again = client.responses.retrieve(streamed.id)
    assert again.status == "completed" and again.output_text == REPLY
    assert (again.id, again.output[0].id, again.usage) == (
        streamed.id, streamed.output[0].id, streamed.usage,
    )  # fmt: skip
    short = client.responses.create(model="m", input="hi", max_output_tokens=4)
    assert client.responses.retrieve(short.id).incomplete_details == short.incomplete_details
    salted = client.responses.create(model="m", input="hi", extra_body={"cache_salt": "t1"})
    assert client.responses.retrieve(salted.id, extra_query={"cache_salt": "t1"}).id == salted.id
    unstored = client.responses.create(model="m", input="hi", store=False)
    for missing, query in [(unstored.id, {}), ("resp_unknown", {}), (salted.id, {})]:
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.retrieve(missing, extra_query=query)
        body: Any = info.value.body
        assert body["type"] == "not_found_error" and missing in body["message"]
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):  # the chain it started is gone too
        client.responses.create(model="m", input="x", previous_response_id=created.id)


def test_retrieve_refuses_a_stream(client: openai.OpenAI) -> None:
    created = client.responses.create(model="m", input="hi")
    r = httpx.get(f"{client.base_url}responses/{created.id}?stream=true", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
