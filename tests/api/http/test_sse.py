"""SSE framing on the wire for both APIs, disconnects, slow readers, many concurrent clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import httpx

from deepinfer.api.app import create_app
from tests.api.fake_engine import REPLY, FakeEngine
from tests.api.live_server import LiveServer


def frames_of(raw: bytes) -> list[bytes]:
    """Split an SSE body on blank lines, checking that it ends with one."""
    assert raw.endswith(b"\n\n"), raw[-50:]
    return raw[:-2].split(b"\n\n")


def test_openai_sse_framing(fake_server: LiveServer) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    r = httpx.post(fake_server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = frames_of(r.content)
    assert frames[-1] == b"data: [DONE]"
    payloads = [json.loads(f.removeprefix(b"data: ")) for f in frames[:-1]]
    assert all(f.startswith(b"data: {") and b"\n" not in f for f in frames[:-1])
    text = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads if p["choices"])
    assert text == REPLY[:5]
    assert payloads[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_anthropic_sse_framing(fake_server: LiveServer) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True}  # fmt: skip
    r = httpx.post(fake_server.url + "/v1/messages", json=body)
    frames = frames_of(r.content)
    names = []
    for f in frames:
        event_line, data_line = f.split(b"\n")
        name = event_line.removeprefix(b"event: ").decode()
        data = json.loads(data_line.removeprefix(b"data: "))
        assert data["type"] == name
        names.append(name)
    assert names == ["message_start", "content_block_start", "ping",
                     *["content_block_delta"] * (len(names) - 6),
                     "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    delta = json.loads(frames[-2].split(b"\n")[1][6:])
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 4


def _wait_free(server: LiveServer, engine: FakeEngine, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.call(lambda: engine.stats().num_blocks_used) != 0:
        assert time.monotonic() < deadline, "blocks were not freed after disconnects"
        time.sleep(0.01)
    server.call(engine.check_integrity)


def test_disconnect_aborts_and_frees_blocks(
    fake_server: LiveServer, fake_engine: FakeEngine
) -> None:
    aborted = fake_engine.num_aborted
    body = {"model": "m", "prompt": "go", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client() as c, c.stream("POST", fake_server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert fake_server.call(lambda: fake_engine.stats().num_blocks_used) > 0
    _wait_free(fake_server, fake_engine)
    assert fake_engine.num_aborted == aborted + 1


def test_disconnect_non_streaming_aborts(fake_server: LiveServer, fake_engine: FakeEngine) -> None:
    aborted = fake_engine.num_aborted
    body = {"model": "m", "prompt": "go", "max_tokens": 1500, "ignore_eos": True}
    with contextlib.suppress(httpx.TimeoutException):
        httpx.post(fake_server.url + "/v1/completions", json=body, timeout=0.3)
    _wait_free(fake_server, fake_engine)
    assert fake_engine.num_aborted == aborted + 1


async def test_slow_reader_gets_merged_deltas() -> None:
    """A send() that lags behind the engine leaves deltas to merge in the mailbox: fewer frames,
    the same text, no queue growing per token."""
    engine = FakeEngine(step_s=0.001)
    app = create_app(engine)
    await engine.start()
    sent: list[bytes] = []
    body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 300, "ignore_eos": True,
                       "stream": True}).encode()  # fmt: skip
    disconnect = asyncio.Event()
    requested: list[bool] = []

    async def receive() -> dict[str, Any]:
        if not requested:
            requested.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            sent.append(message.get("body", b""))
            await asyncio.sleep(0.02)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "query_string": b"",
             "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1)}  # fmt: skip
    try:
        await app(scope, receive, send)  # type: ignore[arg-type]
    finally:
        await engine.shutdown()
    frames = frames_of(b"".join(sent))
    assert frames[-1] == b"data: [DONE]"
    text = "".join(json.loads(f[6:])["choices"][0]["text"] for f in frames[:-1])
    assert text == (REPLY * 10)[:300]
    assert len(frames) < 100 and engine.num_merges > 0


async def test_hundred_concurrent_streams_half_disconnecting(
    fake_server: LiveServer, fake_engine: FakeEngine
) -> None:
    url = fake_server.url + "/v1/chat/completions"

    async def client(i: int, c: httpx.AsyncClient) -> str | None:
        body = {"model": "m", "messages": [{"role": "user", "content": f"client {i}"}],
                "max_tokens": 200, "stream": True}  # fmt: skip
        async with c.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            text, n = [], 0
            async for line in r.aiter_lines():
                if not line:
                    continue
                n += 1
                if i % 2 and n == 3:
                    return None  # disconnect mid-stream
                if line == "data: [DONE]":
                    return "".join(text)
                text.append(json.loads(line[6:])["choices"][0]["delta"].get("content", ""))
        raise AssertionError("stream ended without [DONE]")

    limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=30) as c:
        results = await asyncio.gather(*(client(i, c) for i in range(100)))
        completed = [r for r in results if r is not None]
        assert len(completed) == 50 and all(t == REPLY for t in completed)
        await asyncio.to_thread(_wait_free, fake_server, fake_engine)
        r = await c.get(fake_server.url + "/health")
        assert r.status_code == 200
