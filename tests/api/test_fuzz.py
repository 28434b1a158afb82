"""Schema-driven fuzzing of the HTTP API against the real engine on SmolLM2.

Bodies come from the routes' own msgspec request types (tests/api/schema_fuzz.py). Whatever
the body, the server must answer below 500, a 4xx in the route's error envelope, a 200 that
decodes as the route's response type (streams read to their end: OpenAI's `[DONE]`, Anthropic's
`message_stop`, or an error event), and stay healthy: `/health` after every request, and after
each route's run the same greedy answer to a reference prompt as before any fuzzing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.api.anthropic.schemas import CountTokensRequest, Message, MessagesRequest, TokenCount
from deepinfer.api.openai.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelList,
)
from tests.api.live_server import LiveServer
from tests.api.schema_fuzz import Limits, encode, field_names, request_bodies, sweep_cases

REQUEST_TIMEOUT_S = 30.0
SWEEP_CONCURRENCY = 8
SMALL_MAX_TOKENS = 8
REFERENCE_PROMPT = "What is the capital of France?"


@dataclass(frozen=True)
class Route:
    path: str
    request_type: type
    response_type: type
    chunk_type: type | None
    """The payload of an OpenAI stream's data frames; None for Anthropic's named events."""
    max_examples: int
    unbounded_default: bool = False
    """Without max_tokens the route may generate up to the context: give such bodies a bound."""

    @property
    def anthropic(self) -> bool:
        return self.path.startswith("/v1/messages")


ROUTES = (
    Route("/v1/chat/completions", ChatCompletionRequest, ChatCompletion, ChatCompletionChunk,
          max_examples=50, unbounded_default=True),
    Route("/v1/completions", CompletionRequest, Completion, Completion, max_examples=40),
    Route("/v1/messages", MessagesRequest, Message, None, max_examples=40),
    Route("/v1/messages/count_tokens", CountTokensRequest, TokenCount, None, max_examples=20),
)  # fmt: skip

RAW_BODIES = (
    b"",
    b" ",
    b"not json",
    b"{",
    b"}",
    b"[]",
    b"null",
    b"0",
    b'"messages"',
    b"\xef\xbb\xbf{}",
    b"\xff\xfe{\x00}\x00",
    b'{"messages": [}',
    b'{"messages": NaN}',
    b'{"max_tokens": Infinity}',
    b'{"messages": 1e999}',
    b'{"prompt": "\\ud800", "messages": [{"role": "user", "content": "\\udfff"}]}',
    b'{"a": 1, "a": 2}',
    b"{}" * 100,
    b"[" * 5000 + b"]" * 5000,
    b'{"metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}",
)
"""Bodies that are not a JSON object of the route's type: truncated, non-JSON numbers, BOM,
UTF-16, invalid surrogates, duplicate keys, trailing data, deep nesting."""

FUZZ_SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=list(HealthCheck),
)

# ---- one exchange and its checks


def _limits(server: LiveServer) -> Limits:
    app: Any = server.config.app
    engine = app.state.engine
    return Limits(vocab_size=engine.tokenizer.vocab_size, max_model_len=engine.max_model_len)


def _bounded(route: Route, body: Any) -> Any:
    """Give a body that would generate up to the context a small max_tokens (keeps it fast)."""
    unbounded = isinstance(body, dict) and body.get("max_completion_tokens") is None
    if route.unbounded_default and unbounded and body.get("max_tokens") is None:
        body["max_tokens"] = SMALL_MAX_TOKENS
    return body


def exchange(client: httpx.Client, method: str, route: Route, body: bytes) -> int:
    """Send one request, read the whole answer, and check it; then check /health. The status."""
    start = time.monotonic()
    with client.stream(method, route.path, content=body) as response:
        raw = response.read()
    elapsed_s = time.monotonic() - start
    assert elapsed_s < REQUEST_TIMEOUT_S, f"took {elapsed_s:.1f} s"
    status = response.status_code
    assert status < 500, f"{status}: {raw[:400]!r}"
    if status >= 400:
        _check_error(route, raw)
    elif response.headers["content-type"].startswith("text/event-stream"):
        _check_stream(route, raw)
    else:
        msgspec.json.decode(raw, type=route.response_type)
    health = client.get("/health")
    assert health.status_code == 200, f"/health {health.status_code}: {health.text[:200]}"
    return status


def _check_error(route: Route, raw: bytes) -> None:
    payload = msgspec.json.decode(raw)
    assert isinstance(payload, dict), raw[:200]
    if route.anthropic:
        assert payload.get("type") == "error", raw[:200]
    error = payload.get("error")
    assert isinstance(error, dict), raw[:200]
    assert isinstance(error.get("message"), str) and isinstance(error.get("type"), str), raw[:200]


def _check_stream(route: Route, raw: bytes) -> None:
    assert raw.endswith(b"\n\n"), f"unterminated stream: {raw[-200:]!r}"
    frames = raw[:-2].split(b"\n\n")
    if route.anthropic:
        events = [_anthropic_event(frame) for frame in frames]
        assert events[-1] in ("message_stop", "error"), f"stream ended with {events[-1]}"
        return
    assert frames[-1] == b"data: [DONE]", f"stream ended with {frames[-1][:200]!r}"
    for frame in frames[:-1]:
        assert frame.startswith(b"data: "), frame[:200]
        data = msgspec.json.decode(frame[6:])
        if "error" in data:
            _check_error(route, frame[6:])
        else:
            msgspec.json.decode(frame[6:], type=route.chunk_type)


def _anthropic_event(frame: bytes) -> str:
    head, _, data = frame.partition(b"\ndata: ")
    assert head.startswith(b"event: "), frame[:200]
    event = head[7:].decode()
    payload = msgspec.json.decode(data)
    assert payload.get("type") == event, frame[:200]
    return event


# ---- fixtures


@pytest.fixture(scope="module")
def client(real_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=real_server.url, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


def _reference_text(client: httpx.Client) -> str:
    body = {
        "messages": [{"role": "user", "content": REFERENCE_PROMPT}],
        "temperature": 0,
        "max_tokens": 16,
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    text = msgspec.json.decode(response.content, type=ChatCompletion).choices[0].message.content
    assert text, "the reference prompt got an empty answer"
    return text


@pytest.fixture(scope="module")
def reference(client: httpx.Client) -> str:
    """The reference answer, taken before any request of this module is fuzzed."""
    return _reference_text(client)


def _assert_unharmed(client: httpx.Client, reference: str) -> None:
    assert client.get("/health").status_code == 200
    assert _reference_text(client) == reference


# ---- tests


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES, ids=[r.path for r in ROUTES])
def test_fuzzed_bodies_never_hurt_the_server(
    route: Route, real_server: LiveServer, client: httpx.Client, reference: str
) -> None:
    bodies = request_bodies(route.request_type, _limits(real_server))

    @settings(FUZZ_SETTINGS, max_examples=route.max_examples)
    @given(body=bodies.map(lambda b: _bounded(route, b)))
    def fuzz(body: Any) -> None:
        exchange(client, "POST", route, encode(body))

    fuzz()
    _assert_unharmed(client, reference)


_CHAT = [{"role": "user", "content": "Say hi."}]
SWEEP_BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": _CHAT, "max_tokens": 2, "temperature": 1.0, "seed": 7},
    "/v1/completions": {"prompt": "Once upon a", "max_tokens": 2, "temperature": 1.0, "seed": 7},
    "/v1/messages": {"messages": _CHAT, "max_tokens": 2, "temperature": 1.0},
    "/v1/messages/count_tokens": {"messages": _CHAT},
}
"""Valid sampled requests (temperature 1: numeric trouble shows in draws, not in argmax); two
tokens, so a bad first token also reaches the next forward pass."""


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES, ids=[r.path for r in ROUTES])
def test_every_field_alone_at_every_extreme(
    route: Route, real_server: LiveServer, client: httpx.Client, reference: str
) -> None:
    """One field at a time, at any depth, set to each boundary, extreme and wrong-kind value of
    its type, in an otherwise valid request: what random draws may miss, this always tries.
    `SWEEP_CONCURRENCY` at a time, so bad requests also share the engine's steps."""
    cases = sweep_cases(route.request_type, SWEEP_BASES[route.path], _limits(real_server))

    def send(case: tuple[str, Any]) -> None:
        path, body = case
        try:
            exchange(client, "POST", route, encode(_bounded(route, body)))
        except (AssertionError, httpx.HTTPError) as exc:
            raise AssertionError(f"{route.path} with {path} = {encode(body)[:300]!r}") from exc

    with ThreadPoolExecutor(SWEEP_CONCURRENCY) as pool:
        for _ in pool.map(send, cases):  # the first failure raises here
            pass
    _assert_unharmed(client, reference)


@pytest.mark.slow
@settings(FUZZ_SETTINGS, max_examples=60)
@given(
    route=st.sampled_from(ROUTES),
    body=st.sampled_from(RAW_BODIES) | st.binary(max_size=64),
)
def test_raw_non_json_bodies_get_400(
    route: Route, body: bytes, client: httpx.Client, reference: str
) -> None:
    assert 400 <= exchange(client, "POST", route, body) < 500


@pytest.mark.slow
def test_wrong_methods_and_paths_get_enveloped_4xx(client: httpx.Client, reference: str) -> None:
    for route in ROUTES:
        assert exchange(client, "GET", route, b"") == 405
        assert exchange(client, "PUT", route, b"{}") == 405
    models = Route("/v1/models", object, ModelList, None, max_examples=0)
    assert exchange(client, "GET", models, b"") == 200
    assert exchange(client, "POST", models, b"{}") == 405
    assert exchange(client, "GET", Route("/v1/nowhere", object, object, None, 0), b"") == 404
    nowhere = Route("/v1/messages/nowhere", object, object, None, 0)
    assert exchange(client, "POST", nowhere, b"{}") == 404
    _assert_unharmed(client, reference)


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES, ids=[r.path for r in ROUTES])
def test_strategies_reach_every_schema_field(route: Route) -> None:
    """Plausible bodies hold every field of the request type, nested ones included (a field of a
    type the strategies do not know raises)."""
    seen: set[str] = set()
    limits = Limits(vocab_size=49152, max_model_len=8192)
    bodies = request_bodies(route.request_type, limits, rates=(0,))

    @settings(FUZZ_SETTINGS, max_examples=150)
    @given(body=bodies)
    def collect(body: Any) -> None:
        _collect_keys(body, seen)

    collect()
    missing = field_names(route.request_type) - seen
    assert not missing, f"never drawn: {sorted(missing)}"


def _collect_keys(value: Any, seen: set[str]) -> None:
    if isinstance(value, dict):
        seen.update(value)
        for v in value.values():
            _collect_keys(v, seen)
    elif isinstance(value, list):
        for v in value[:4]:
            _collect_keys(v, seen)
