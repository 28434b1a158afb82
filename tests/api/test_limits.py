"""Request limits: each refused with a 400 in the API's own envelope naming the field and the
limit, before the work it bounds; one below the limit is served. JSON nesting is checked on the
raw body; a prompt that cannot fit the context is refused before it is tokenized."""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deepinfer.api.app import create_app
from deepinfer.api.http.body import decode_json, json_depth
from deepinfer.api.http.errors import ApiError
from deepinfer.api.openai.schemas import ChatCompletionRequest
from deepinfer.config import CacheConfig, Config, DiskCacheConfig, ModelConfig, SchedulerConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.errors import ConfigError
from deepinfer.server_config import RequestLimits, ServerConfig
from tests.api.fake_engine import FakeEngine, FakeRecipe, FakeTokenizer
from tests.api.live_server import LiveServer

LIMITS = RequestLimits(
    max_json_depth=8,
    max_messages=4,
    max_stop_strings=2,
    max_stop_string_chars=8,
    max_stop_token_ids=3,
    max_logit_bias=3,
    max_tools=2,
    max_schema_bytes=300,
)
MAX_MODEL_LEN = 2048

Body = dict[str, Any]


class CountingTokenizer(FakeTokenizer):
    """One token per character (at most 4 bytes of UTF-8), stated so the API can bound prompts."""

    max_token_bytes = 4

    def __init__(self) -> None:
        self.num_chars_encoded = 0

    def encode(self, text: str) -> list[int]:
        self.num_chars_encoded += len(text)
        return super().encode(text)


@pytest.fixture(scope="module")
def limited() -> Iterator[tuple[httpx.Client, CountingTokenizer]]:
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN)
    tokenizer = CountingTokenizer()
    engine.tokenizer, engine.recipe = tokenizer, FakeRecipe(tokenizer)
    config = ServerConfig(max_body_bytes=8 << 20, limits=LIMITS)
    server = LiveServer(create_app(engine, config)).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            yield client, tokenizer
    finally:
        server.stop()


@pytest.fixture
def client(limited: tuple[httpx.Client, CountingTokenizer]) -> httpx.Client:
    return limited[0]


def user(n: int = 1) -> list[Body]:
    return [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}"} for i in range(n)]


def tool(name: str, size: int = 0) -> Body:
    return {"name": name, "description": "d" * size, "input_schema": {"type": "object"}}


def function_tool(name: str, size: int = 0) -> Body:
    """An OpenAI function tool."""
    function = {"name": name, "description": "d" * size, "parameters": {"type": "object"}}
    return {"type": "function", "function": function}


def chat(**fields: Any) -> tuple[str, Body]:
    return "/v1/chat/completions", {"messages": user(), "max_tokens": 3, **fields}


def completion(**fields: Any) -> tuple[str, Body]:
    return "/v1/completions", {"prompt": "hi", "max_tokens": 3, **fields}


def messages(**fields: Any) -> tuple[str, Body]:
    return "/v1/messages", {"messages": user(), "max_tokens": 3, **fields}


def count_tokens(**fields: Any) -> tuple[str, Body]:
    return "/v1/messages/count_tokens", {"messages": user(), **fields}


def responses(**fields: Any) -> tuple[str, Body]:
    return "/v1/responses", {"input": "hi", "max_output_tokens": 3, **fields}


def flat_tool(name: str, size: int = 0) -> Body:
    """A Responses function tool."""
    parameters = {"type": "object"}
    return {"type": "function", "name": name, "description": "d" * size, "parameters": parameters}


def text_format(size: int) -> Body:
    """A Responses `text` whose json_schema format's schema is `size` bytes of JSON."""
    schema = {"description": "x" * (size - schema_size({"description": ""}))}
    assert schema_size(schema) == size
    return {"format": {"type": "json_schema", "name": "s", "schema": schema}}


def json_schema(size: int) -> Body:
    return {"type": "json_schema", "json_schema": {"name": "x" * size, "schema": {}}}


def compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def schema_size(value: Any) -> int:
    return len(compact(value))


def post(client: httpx.Client, path: str, body: Body) -> httpx.Response:
    """Compact JSON, so that raw sizes are those computed here."""
    return client.post(path, content=compact(body), headers={"content-type": "application/json"})


def fitting_tools(tool: Callable[..., Body] = tool) -> list[Body]:
    """Two tools whose JSON is exactly max_schema_bytes together."""
    room = LIMITS.max_schema_bytes - schema_size(tool("a")) - schema_size(tool("b"))
    tools = [tool("a"), tool("b", room)]
    assert schema_size(tools[0]) + schema_size(tools[1]) == LIMITS.max_schema_bytes
    return tools


def fitting_format() -> Body:
    return json_schema(LIMITS.max_schema_bytes - schema_size(json_schema(0)))


Case = Callable[..., tuple[str, Body]]
# (request, field at the limit, field one over it, param, limit name)
CASES: list[tuple[Case, Body, Body, str, str]] = [
    (chat, {"messages": user(4)}, {"messages": user(5)}, "messages", "max_messages"),
    (chat, {"stop": ["a", "b"]}, {"stop": ["a", "b", "c"]}, "stop", "max_stop_strings"),
    (chat, {"stop": "s" * 8}, {"stop": "s" * 9}, "stop", "max_stop_string_chars"),
    (chat, {"stop": ["a", "s" * 8]}, {"stop": ["a", "s" * 9]}, "stop[1]", "max_stop_string_chars"),
    (
        chat,
        {"stop_token_ids": [7, 8, 9]},
        {"stop_token_ids": [7, 8, 9, 10]},
        "stop_token_ids",
        "max_stop_token_ids",
    ),
    (
        chat,
        {"logit_bias": {"1": 1.0, "2": 0.5, "3": -1.0}},
        {"logit_bias": {"1": 1.0, "2": 0.5, "3": -1.0, "4": 0.0}},
        "logit_bias",
        "max_logit_bias",
    ),
    (
        chat,
        {"tools": [function_tool("a"), function_tool("b")]},
        {"tools": [function_tool(c) for c in "abc"]},
        "tools",
        "max_tools",
    ),
    (
        chat,
        {"tools": fitting_tools(function_tool)},
        {"tools": [function_tool("a"), function_tool("bb", LIMITS.max_schema_bytes - 100)]},
        "tools",
        "max_schema_bytes",
    ),
    (
        chat,
        {"response_format": fitting_format()},
        {"response_format": json_schema(LIMITS.max_schema_bytes)},
        "response_format",
        "max_schema_bytes",
    ),
    (completion, {"stop": ["a", "b"]}, {"stop": ["a", "b", "c"]}, "stop", "max_stop_strings"),
    (completion, {"stop": "s" * 8}, {"stop": "s" * 9}, "stop", "max_stop_string_chars"),
    (
        completion,
        {"stop_token_ids": [7, 8, 9]},
        {"stop_token_ids": [1, 2, 3, 4]},
        "stop_token_ids",
        "max_stop_token_ids",
    ),
    (
        completion,
        {"logit_bias": {"1": 1, "2": 1, "3": 1}},
        {"logit_bias": {"1": 1, "2": 1, "3": 1, "4": 1}},
        "logit_bias",
        "max_logit_bias",
    ),
    (messages, {"messages": user(4)}, {"messages": user(5)}, "messages", "max_messages"),
    (
        messages,
        {"stop_sequences": ["a", "b"]},
        {"stop_sequences": ["a", "b", "c"]},
        "stop_sequences",
        "max_stop_strings",
    ),
    (
        messages,
        {"stop_sequences": ["s" * 8]},
        {"stop_sequences": ["s" * 9]},
        "stop_sequences[0]",
        "max_stop_string_chars",
    ),
    (
        messages,
        {"tools": [tool("a"), tool("b")]},
        {"tools": [tool(c) for c in "abc"]},
        "tools",
        "max_tools",
    ),
    (
        messages,
        {"tools": fitting_tools()},
        {"tools": [tool("a", LIMITS.max_schema_bytes)]},
        "tools",
        "max_schema_bytes",
    ),
    (count_tokens, {"messages": user(4)}, {"messages": user(5)}, "messages", "max_messages"),
    (responses, {"input": user(4)}, {"input": user(5)}, "input", "max_messages"),
    (
        responses,
        {"tools": [flat_tool("a"), flat_tool("b")]},
        {"tools": [flat_tool(c) for c in "abc"]},
        "tools",
        "max_tools",
    ),
    (
        responses,
        {"tools": fitting_tools(flat_tool)},
        {"tools": [flat_tool("a"), flat_tool("bb", LIMITS.max_schema_bytes - 100)]},
        "tools",
        "max_schema_bytes",
    ),
    (
        responses,
        {"text": text_format(LIMITS.max_schema_bytes)},
        {"text": text_format(LIMITS.max_schema_bytes + 1)},
        "text.format.schema",
        "max_schema_bytes",
    ),
    (
        count_tokens,
        {"tools": fitting_tools()},
        {"tools": [tool(c) for c in "abc"]},
        "tools",
        "max_tools",
    ),
]


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def assert_refused(response: httpx.Response, path: str, param: str, limit_name: str) -> str:
    """400 in the route's envelope, naming the field and the limit; returns the message."""
    assert response.status_code == 400, response.text
    payload = response.json()
    if is_anthropic(path):
        assert payload["type"] == "error"
        assert payload["error"]["type"] == "invalid_request_error"
        message: str = payload["error"]["message"]
    else:
        assert payload["error"]["type"] == "invalid_request_error"
        assert payload["error"]["param"] == param
        message = payload["error"]["message"]
    assert message.startswith(f"{param}: at most ")
    assert f"(server limit {limit_name})" in message
    return message


@pytest.mark.parametrize(
    ("request_of", "at_limit", "over", "param", "limit_name"),
    CASES,
    ids=[f"{c[0].__name__}-{c[3]}-{c[4]}" for c in CASES],
)
def test_each_limit_refused_over_and_served_at(
    client: httpx.Client,
    request_of: Case,
    at_limit: Body,
    over: Body,
    param: str,
    limit_name: str,
) -> None:
    path, body = request_of(**at_limit)
    served = post(client, path, body)
    assert served.status_code == 200, served.text
    path, body = request_of(**over)
    assert_refused(post(client, path, body), path, param, limit_name)


def test_the_message_states_the_limit_and_the_size(client: httpx.Client) -> None:
    path, body = chat(stop=["a", "b", "c"])
    message = assert_refused(post(client, path, body), path, "stop", "max_stop_strings")
    assert message == (
        "stop: at most 2 stop strings are accepted (server limit max_stop_strings); got 3"
    )


def test_more_sequences_than_the_queue_ever_holds_is_a_400_not_a_429() -> None:
    """More sequences (prompts times `n`) than the waiting queue holds can never be queued,
    however long the client waits: a 400 naming the limit. At the limit, a full queue is a
    429 with Retry-After, which clears."""
    engine = FakeEngine(max_active=0, max_waiting=4)
    server = LiveServer(create_app(engine)).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for (path, body), param in (
                (chat(n=5), "n"),
                (completion(n=5), "n"),
                (completion(prompt=["a", "b", "c"], n=2), "prompt"),
            ):
                message = assert_refused(post(client, path, body), path, param, "max_waiting")
                assert message.endswith("got 5" if param == "n" else "got 6")
            for path, body in (chat(n=4), completion(prompt=["a", "b"], n=2), responses()):
                busy = post(client, path, body)
                assert busy.status_code == 429 and busy.headers["retry-after"] == "2", busy.text
            engine.max_active = 256
            assert post(client, *chat(n=4)).status_code == 200
    finally:
        server.stop()


def test_a_queue_that_holds_nothing_is_a_config_error() -> None:
    """`--max-waiting 0` would answer every request 429, forever."""
    with pytest.raises(ConfigError, match="max_waiting must be at least 1, got 0"):
        Config(scheduler=SchedulerConfig(max_waiting=0))


def test_the_engine_refuses_more_sequences_than_its_queue_holds() -> None:
    """The real engine (over the null model) states its queue bound to the API."""
    config = Config(
        model=ModelConfig(path=Path("null")),
        cache=CacheConfig(kv_memory_bytes=64 << 20),
        disk_cache=DiskCacheConfig(enabled=False),
        scheduler=SchedulerConfig(max_waiting=2),
    )
    server = LiveServer(create_app(AsyncEngine(config), config.server)).start(timeout_s=120)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            path, body = completion(n=3)
            assert_refused(post(client, path, body), path, "n", "max_waiting")
            assert post(client, *completion(n=2)).status_code == 200
    finally:
        server.stop()


def test_a_megabyte_stop_string_is_refused_before_any_matcher_is_built(
    client: httpx.Client,
) -> None:
    started = time.perf_counter()
    path, body = messages(stop_sequences=["y" * 1_000_000])
    response = post(client, path, body)
    assert_refused(response, path, "stop_sequences[0]", "max_stop_string_chars")
    assert "got 1000000" in response.json()["error"]["message"]
    assert time.perf_counter() - started < 5.0


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


ROUTES: list[Case] = [chat, completion, messages, count_tokens, responses]


@pytest.mark.parametrize("request_of", ROUTES, ids=[r.__name__ for r in ROUTES])
def test_nesting_over_the_limit_is_a_400_on_every_route(
    client: httpx.Client, fake_server: LiveServer, request_of: Case
) -> None:
    """At the limit (the body object counts as a level) it is decoded and served; 2,000 levels,
    on a server with the default limit, is a 400 naming max_json_depth, not a 500."""
    path, body = request_of(extra=nested(LIMITS.max_json_depth - 1))
    assert post(client, path, body).status_code == 200
    path, body = request_of(extra=nested(LIMITS.max_json_depth))
    over = post(client, path, body)
    assert over.status_code == 400
    path, body = request_of(extra="@")
    raw = compact(body).replace(b'"@"', b"[" * 2000 + b"0" + b"]" * 2000)
    response = httpx.post(fake_server.url + path, content=raw, timeout=30)
    assert response.status_code == 400, response.text
    payload = response.json()
    assert ("type" in payload) == is_anthropic(path)  # the route's own envelope
    message = payload["error"]["message"]
    assert "2001 levels deep" in message and "(server limit max_json_depth)" in message
    assert message.startswith("body: ")


def test_nesting_inside_strings_does_not_count(client: httpx.Client) -> None:
    text = '[[[[[[[[[[ \\" {{{{{{{{{{{ \\\\'
    path, body = chat(messages=[{"role": "user", "content": text}], stop=["[[[[[[[["])
    assert post(client, path, body).status_code == 200


def reference_depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(reference_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(reference_depth, value.values()), default=0)
    return 0


def random_json(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 7 or roll < 0.3:
        return rng.choice(["a\\", 'x"[{', '\\"]]', "]}\\\\", 1, None, "é[", '\\\\\\"{', ""])
    if roll < 0.65:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["k", "[", '\\"{', "\\", '"']
    return {f"{rng.choice(keys)}{i}": random_json(rng, depth + 1) for i in range(rng.randint(0, 3))}


def test_json_depth_matches_a_parser_with_escapes_and_brackets_in_strings() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        value = random_json(rng)
        raw = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        assert json_depth(raw) == reference_depth(value), raw


def test_json_depth_of_a_4mb_body_takes_milliseconds() -> None:
    """Dense brackets, quotes and escapes throughout: a per-byte Python loop would take seconds."""
    content = 'a\\"[b{' * 400_000
    body = json.dumps({"messages": [{"content": content}], "x": [[[1]]] * 150_000}).encode()
    assert len(body) > 4_000_000
    started = time.perf_counter()
    assert json_depth(body) == 4
    assert time.perf_counter() - started < 0.5


def test_recursion_while_decoding_is_a_400() -> None:
    """Backstop: with the depth check set out of reach, the decoder's own RecursionError still
    becomes a 400 naming the limit."""
    depth = sys.getrecursionlimit() * 20
    body = b'{"messages": [], "x": ' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(ApiError) as refused:
        decode_json(body, ChatCompletionRequest, max_json_depth=depth * 2)
    assert refused.value.openai_status == 400
    assert "max_json_depth" in refused.value.message


def test_a_4mb_prompt_is_refused_without_tokenizing(
    limited: tuple[httpx.Client, CountingTokenizer],
) -> None:
    """4 bytes per token at most: 4 MB of text is at least 1M tokens, far over 2048."""
    client, tokenizer = limited
    text = "abcd" * 1_000_000
    before = tokenizer.num_chars_encoded
    for path, body in (completion(prompt=text), chat(messages=[{"role": "user", "content": text}])):
        response = post(client, path, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert f"at least {len(text) // 4} tokens" in error["message"]
    assert tokenizer.num_chars_encoded == before
    path, body = messages(messages=[{"role": "user", "content": text}])
    response = post(client, path, body)
    assert response.status_code == 400 and response.json()["type"] == "error"
    assert tokenizer.num_chars_encoded == before
    ids = list(range(3, 3 + MAX_MODEL_LEN + 1))
    path, body = completion(prompt=ids)
    assert post(client, path, body).json()["error"]["code"] == "context_length_exceeded"


def test_a_prompt_just_inside_the_bound_is_tokenized(
    limited: tuple[httpx.Client, CountingTokenizer],
) -> None:
    """Bytes = max_model_len * 4 may still fit (here it does not, once tokenized: the engine
    refuses it, after counting its tokens); counting tokens is never refused for length."""
    client, tokenizer = limited
    text = "abcd" * (MAX_MODEL_LEN - 1)
    before = tokenizer.num_chars_encoded
    path, body = completion(prompt=text)
    error = post(client, path, body).json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"({len(text)} prompt + 3 max_tokens)" in error["message"]  # counted, then refused
    assert tokenizer.num_chars_encoded == before + len(text)
    long = "abcd" * MAX_MODEL_LEN * 2
    path, body = count_tokens(messages=[{"role": "user", "content": long}])
    counted = post(client, path, body)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > len(long)


@pytest.mark.slow
def test_real_server_refuses_a_3mb_prompt_untokenized(real_server: LiveServer) -> None:
    """SmolLM2's longest token is 81 bytes: 3 MB is at least 37,038 tokens, over its 8192. The
    message gives that lower bound (tokenizing would have given the exact count)."""
    text = "lorem ipsum " * 250_000
    started = time.perf_counter()
    for path, body in (
        completion(prompt=text),
        messages(messages=[{"role": "user", "content": text}]),
    ):
        response = httpx.post(real_server.url + path, content=compact(body), timeout=60)
        assert response.status_code == 400, response.text
        assert f"at least {-(-len(text) // 81)} tokens" in response.json()["error"]["message"]
    assert time.perf_counter() - started < 10.0
