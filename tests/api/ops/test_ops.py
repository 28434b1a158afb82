"""Operations: health, Prometheus metrics, API keys, body limits, mounting under a prefix."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from deepinfer.api.app import create_app, engine_lifespan
from deepinfer.server_config import ServerConfig
from tests.api.fake_engine import REPLY, FakeEngine
from tests.api.live_server import LiveServer


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_health_and_metrics_count_what_was_served() -> None:
    engine = FakeEngine()
    server = LiveServer(create_app(engine)).start()
    try:
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
            rs = [c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q" * 40}],
                                            max_tokens=7) for _ in range(2)]  # fmt: skip
            with pytest.raises(openai.BadRequestError):
                c.chat.completions.create(model="m", messages=[])
        m = samples(httpx.get(server.url + "/metrics").text)
    finally:
        server.stop()
    ok = ("deepinfer_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))
    bad = ("deepinfer_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "400")))
    assert m[ok] == 2 and m[bad] == 1
    usage = [r.usage for r in rs]
    assert all(u is not None for u in usage)
    assert m[("deepinfer_prompt_tokens_total", ())] == sum(u.prompt_tokens for u in usage if u)
    assert m[("deepinfer_generation_tokens_total", ())] == 14
    cached = sum(
        u.prompt_tokens_details.cached_tokens for u in usage if u and u.prompt_tokens_details
    )
    device = m[("deepinfer_cached_prompt_tokens_total", (("tier", "device"),))]
    disk = m[("deepinfer_cached_prompt_tokens_total", (("tier", "disk"),))]
    assert device + disk == cached > 0
    assert m[("deepinfer_time_to_first_token_seconds_count", ())] == 2
    assert m[("deepinfer_inter_token_latency_seconds_count", ())] == 12
    assert m[("deepinfer_engine_step_seconds_count", (("worker", "mixed"),))] > 0
    assert m[("deepinfer_kv_blocks_used", ())] == 0
    assert m[("deepinfer_kv_blocks_total", ())] == engine.num_blocks
    assert ("deepinfer_num_requests_waiting", ()) in m


def test_api_key() -> None:
    server = LiveServer(create_app(FakeEngine(), ServerConfig(api_key="sekret"))).start()
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        msgs: list[openai.types.chat.ChatCompletionMessageParam] = [
            {"role": "user", "content": "x"}
        ]
        with (
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as c,
            pytest.raises(openai.AuthenticationError),
        ):
            c.chat.completions.create(model="m", messages=msgs, max_tokens=2)
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": msgs})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/metrics").status_code == 401
        with openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0) as c:
            assert c.chat.completions.create(model="m", messages=msgs, max_tokens=2).choices
        with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as a:
            with pytest.raises(anthropic.AuthenticationError) as info:
                a.messages.create(
                    model="m", max_tokens=2, messages=[{"role": "user", "content": "x"}]
                )
            body = info.value.body
            assert isinstance(body, dict) and body["error"]["type"] == "authentication_error"
        with anthropic.Anthropic(base_url=server.url, api_key="sekret", max_retries=0) as a:
            m = a.messages.create(
                model="m", max_tokens=2, messages=[{"role": "user", "content": "x"}]
            )
            assert m.content
    finally:
        server.stop()


def test_oversized_bodies_get_413(fake_server: LiveServer) -> None:
    big = b'{"prompt": "' + b"x" * 100_000 + b'"}'
    r = httpx.post(fake_server.url + "/v1/completions", content=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted while reading
        for _ in range(100):
            yield b"x" * 1000

    r = httpx.post(fake_server.url + "/v1/messages", content=chunks())
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    assert httpx.get(fake_server.url + "/health").status_code == 200


def test_unknown_route_and_method(fake_server: LiveServer) -> None:
    r = httpx.get(fake_server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(fake_server.url + "/v1/chat/completions")
    assert r.status_code == 405


def test_mounted_under_prefix_in_host_app() -> None:
    engine = FakeEngine()

    @contextlib.asynccontextmanager
    async def host_lifespan(app: Starlette) -> AsyncIterator[None]:
        async with engine_lifespan(engine):
            yield

    async def home(request: Request) -> PlainTextResponse:
        return PlainTextResponse("host")

    host = Starlette(
        routes=[Route("/", home), Mount("/llm", app=create_app(engine))], lifespan=host_lifespan
    )
    server = LiveServer(host).start()
    try:
        assert httpx.get(server.url + "/").text == "host"
        assert httpx.get(server.url + "/llm/health").json() == {"status": "ok"}
        with openai.OpenAI(base_url=server.url + "/llm/v1", api_key="x", max_retries=0) as c:
            r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
            assert r.choices[0].message.content == REPLY
            assert [m.id for m in c.models.list().data] == ["fake-model"]
        with anthropic.Anthropic(base_url=server.url + "/llm", api_key="x", max_retries=0) as a:
            m = a.messages.create(
                model="m", max_tokens=3, messages=[{"role": "user", "content": "x"}]
            )
            assert m.content[0].type == "text" and m.content[0].text == REPLY[:3]
        assert httpx.get(server.url + "/llm/nope").status_code == 404
    finally:
        server.stop()
    assert not engine.is_running
