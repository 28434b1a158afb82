"""Connection hygiene on a live server built by the real `uvicorn_config`: stalled request heads
and bodies are closed, bodies slower than the minimum rate too, idle keep-alive connections too,
slow but steady clients are not, the connection cap answers 503, and one client address cannot
hold every connection. Raw sockets, sub-second deadlines; a second client binds 127.0.0.2."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import h11
import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from deepinfer import cli
from deepinfer.api.app import create_app
from deepinfer.api.http.connections import (
    H11HeadTimeoutProtocol,
    SharedConnection,
    http_protocol,
    httptools_protocol,
)
from deepinfer.api.server import uvicorn_config
from deepinfer.args import config_from_args
from deepinfer.config import Config
from deepinfer.errors import ConfigError
from deepinfer.server_config import ServerConfig
from tests.api.fake_engine import REPLY, FakeEngine
from tests.api.live_server import LiveServer

HEADER_S, BODY_S, KEEP_ALIVE_S = 1.2, 0.5, 0.4
GRACE_S, MIN_RATE = 0.6, 10.0  # a body past 0.6 s must average 10 bytes/s
SLACK_S = 1.5  # a loaded machine may fire a timer late, never early
EARLY_S = 0.05  # timer and clock granularity
CHAT = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
).encode()


def start_server(engine: FakeEngine, server: ServerConfig) -> LiveServer:
    app = create_app(engine, server)
    return LiveServer(config=uvicorn_config(app, Config(server=server))).start()


@pytest.fixture(scope="module")
def guarded() -> Iterator[LiveServer]:
    server = ServerConfig(
        port=0,
        header_timeout_s=HEADER_S,
        body_timeout_s=BODY_S,
        body_grace_s=GRACE_S,
        min_body_rate_bytes_per_s=MIN_RATE,
        keep_alive_timeout_s=KEEP_ALIVE_S,
    )
    live = start_server(FakeEngine(step_s=0.02), server)
    try:
        yield live
    finally:
        live.stop()


_opened: list[socket.socket] = []


@pytest.fixture(autouse=True)
def close_sockets() -> Iterator[None]:
    """Close every socket a test opened with `connect` (the server closing its end does not
    close ours)."""
    yield
    close_opened()


def close_opened() -> None:
    while _opened:
        _opened.pop().close()


def connect(server: LiveServer, client: str = "127.0.0.1") -> socket.socket:
    """A connection from the loopback address `client` (each address is another client)."""
    sock = socket.create_connection(
        ("127.0.0.1", server.port), timeout=5, source_address=(client, 0)
    )
    _opened.append(sock)
    return sock


def head(method: str, path: str, content_length: int | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test"]
    if content_length is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {content_length}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_until_closed(sock: socket.socket, start_s: float, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sent until it closed, and the seconds from `start_s` to the close;
    fails if the connection is still open `limit_s` after `start_s`."""
    data = b""
    while (remaining_s := start_s + limit_s - time.monotonic()) > 0:
        sock.settimeout(remaining_s)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return data, time.monotonic() - start_s
        if not chunk:
            return data, time.monotonic() - start_s
        data += chunk
    pytest.fail(f"the connection is still open after {limit_s} s (got {data[:200]!r})")


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One response (with Content-Length) off a connection that stays open."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-response: {data!r}"
        data += chunk
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode().split("\r\n")
    fields = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(fields["content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), body


def trickle(sock: socket.socket, data: bytes, interval_s: float) -> threading.Thread:
    """Send `data` a byte every `interval_s` in the background until sent or the socket fails."""

    def run() -> None:
        for i in range(len(data)):
            try:
                sock.sendall(data[i : i + 1])
            except OSError:
                return
            time.sleep(interval_s)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def status_and_json(data: bytes) -> tuple[int, dict[str, Any]]:
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    assert b"connection: close" in head_bytes.lower()
    return int(head_bytes.split()[1]), json.loads(body)


@pytest.mark.slow
def test_trickled_head_is_closed_at_the_header_timeout(guarded: LiveServer) -> None:
    start_s = time.monotonic()
    sock = connect(guarded)
    trickle(sock, head("GET", "/health") * 4, interval_s=0.1)  # never a whole head in time
    _, elapsed_s = read_until_closed(sock, start_s, HEADER_S + SLACK_S)
    assert elapsed_s >= HEADER_S - EARLY_S


@pytest.mark.slow
def test_half_head_after_a_response_is_closed_at_the_header_timeout(guarded: LiveServer) -> None:
    sock = connect(guarded)
    sock.sendall(head("GET", "/health"))
    assert read_response(sock) == (200, b'{"status":"ok"}')
    start_s = time.monotonic()
    time.sleep(0.1)  # within the keep-alive timeout: these bytes cancel uvicorn's idle timer
    sock.sendall(b"GET /health HTTP/1.1\r\nHo")
    _, elapsed_s = read_until_closed(sock, start_s, HEADER_S + SLACK_S)
    assert elapsed_s >= HEADER_S - EARLY_S


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_short_body_is_answered_408_and_closed(guarded: LiveServer, path: str) -> None:
    start_s = time.monotonic()
    sock = connect(guarded)
    sock.sendall(head("POST", path, content_length=100) + b'{"model": ')  # 10 of 100 bytes
    data, elapsed_s = read_until_closed(sock, start_s, BODY_S + SLACK_S)
    assert elapsed_s >= BODY_S - EARLY_S
    status, body = status_and_json(data)
    assert status == 408
    if path == "/v1/messages":  # Anthropic's envelope
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["code"] == "request_timeout"
    assert "stalled for more than 0.5 s" in body["error"]["message"]


@pytest.mark.slow
def test_body_slower_than_the_minimum_rate_is_answered_408_after_its_grace(
    guarded: LiveServer,
) -> None:
    start_s = time.monotonic()
    sock = connect(guarded)
    sock.sendall(head("POST", "/v1/chat/completions", content_length=100))
    # 5 bytes/s: every gap is within the stall timeout, the average under the minimum rate
    trickle(sock, b"x" * 100, interval_s=BODY_S * 0.4)
    # due once t = GRACE_S + received / MIN_RATE, about GRACE_S + t / 2 here
    data, elapsed_s = read_until_closed(sock, start_s, 2 * GRACE_S + SLACK_S)
    assert elapsed_s >= GRACE_S - EARLY_S
    status, body = status_and_json(data)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert "slower than 10 bytes/s after its first 0.6 s" in body["error"]["message"]


def test_idle_keep_alive_is_closed_at_the_keep_alive_timeout(guarded: LiveServer) -> None:
    sock = connect(guarded)
    sock.sendall(head("GET", "/health"))
    assert read_response(sock)[0] == 200
    start_s = time.monotonic()
    data, elapsed_s = read_until_closed(sock, start_s, HEADER_S - EARLY_S)
    assert data == b""
    assert elapsed_s >= KEEP_ALIVE_S - EARLY_S


@pytest.mark.slow
def test_slow_steady_body_is_not_cut(guarded: LiveServer) -> None:
    sock = connect(guarded)
    pieces = [CHAT[i : i + 10] for i in range(0, len(CHAT), 10)]
    assert len(pieces) * BODY_S / 2 > max(HEADER_S, 2 * BODY_S)  # outlasts either deadline
    sock.sendall(head("POST", "/v1/chat/completions", content_length=len(CHAT)))
    for piece in pieces:
        time.sleep(BODY_S / 2)
        sock.sendall(piece)
    status, body = read_response(sock)
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"] == REPLY[:5]


@pytest.mark.slow
def test_streamed_response_outlasting_the_body_timeout_is_not_cut(guarded: LiveServer) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    start_s = time.monotonic()
    with httpx.stream("POST", guarded.url + "/v1/chat/completions", json=body) as r:
        text = "".join(r.iter_text())
    assert time.monotonic() - start_s > 2 * BODY_S  # 66 tokens, a step every 20 ms
    assert text.rstrip().endswith("data: [DONE]")


@pytest.mark.slow
def test_many_stalled_connections_are_closed_while_others_are_served(
    guarded: LiveServer,
) -> None:
    start_s = time.monotonic()
    heads = [connect(guarded) for _ in range(25)]
    bodies = [connect(guarded) for _ in range(25)]
    for sock in heads:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: te")
    for sock in bodies:
        sock.sendall(head("POST", "/v1/chat/completions", content_length=100) + b"{")
    assert httpx.get(guarded.url + "/health").json() == {"status": "ok"}
    r = httpx.post(guarded.url + "/v1/chat/completions", content=CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == REPLY[:5]
    served_s = time.monotonic() - start_s
    limit_s = HEADER_S + SLACK_S
    closed = [read_until_closed(sock, start_s, limit_s) for sock in heads]
    assert all(data == b"" for data, _ in closed)
    assert min(elapsed_s for _, elapsed_s in closed) > served_s, "served while those stalled"
    answers = [status_and_json(read_until_closed(s, start_s, limit_s)[0]) for s in bodies]
    assert [status for status, _ in answers] == [408] * 25


def test_connections_beyond_the_cap_get_503_until_others_close() -> None:
    server = ServerConfig(port=0, max_connections=3)
    live = start_server(FakeEngine(), server)
    try:
        socks = [connect(live) for _ in range(3)]
        for sock in socks:
            sock.sendall(head("GET", "/health"))
            assert read_response(sock)[0] == 200
        extra = connect(live)
        extra.sendall(head("GET", "/health"))
        data, _ = read_until_closed(extra, time.monotonic(), SLACK_S)
        assert data.startswith(b"HTTP/1.1 503 "), data
        for sock in socks:
            sock.close()
        deadline_s = time.monotonic() + SLACK_S
        while httpx.get(live.url + "/health").status_code != 200:
            assert time.monotonic() < deadline_s, "still refusing after the others closed"
            time.sleep(0.05)
    finally:
        live.stop()


CAP = 6


@pytest.fixture
def capped() -> Iterator[LiveServer]:
    live = start_server(FakeEngine(step_s=0.05), ServerConfig(port=0, max_connections=CAP))
    try:
        yield live
    finally:
        close_opened()  # else the shutdown waits for the bodies still due
        live.stop()


def wait_for_tasks(live: LiveServer, num_tasks: int) -> None:
    """Until the server runs `num_tasks` requests (each head read, the app called)."""
    deadline_s = time.monotonic() + SLACK_S
    while live.call(lambda: len(live.server.server_state.tasks)) != num_tasks:
        assert time.monotonic() < deadline_s, f"the server never ran {num_tasks} requests"
        time.sleep(0.02)


def open_stalled_body(live: LiveServer, client: str) -> socket.socket:
    sock = connect(live, client)
    sock.sendall(head("POST", "/v1/chat/completions", content_length=100) + b"{")
    return sock


def test_a_client_holding_every_connection_gives_its_oldest_stalled_ones_up(
    capped: LiveServer,
) -> None:
    hostile = [open_stalled_body(capped, "127.0.0.2") for _ in range(CAP)]
    wait_for_tasks(capped, CAP)  # every connection mid-body, the cap reached
    other = connect(capped)
    other.sendall(head("GET", "/health"))
    assert read_response(other) == (200, b'{"status":"ok"}')
    assert read_until_closed(hostile[0], time.monotonic(), SLACK_S)[0] == b""
    for i in range(1, 4):  # each new connection of the holder costs it its oldest
        hostile.append(open_stalled_body(capped, "127.0.0.2"))
        assert read_until_closed(hostile[i], time.monotonic(), SLACK_S)[0] == b""
        other.sendall(head("GET", "/health"))
        assert read_response(other) == (200, b'{"status":"ok"}')
    sock = connect(capped)  # a second connection of the other client's, still within its share
    sock.sendall(head("POST", "/v1/chat/completions", content_length=len(CHAT)) + CHAT)
    status, body = read_response(sock)
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == REPLY[:5]


def test_connections_serving_whole_requests_are_never_closed_for_another(
    capped: LiveServer,
) -> None:
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
         "stream": True}
    ).encode()  # fmt: skip
    busy = [connect(capped, "127.0.0.2") for _ in range(CAP)]
    request = head("POST", "/v1/chat/completions", content_length=len(body)) + body
    for sock in busy:
        sock.sendall(request.replace(b"Host: test", b"Host: test\r\nConnection: close"))
    wait_for_tasks(capped, CAP)
    other = connect(capped)
    other.sendall(head("GET", "/health"))
    data, _ = read_until_closed(other, time.monotonic(), SLACK_S)
    assert data.startswith(b"HTTP/1.1 503 "), data  # as without shares: nothing stalled to close
    for sock in busy:
        text = read_until_closed(sock, time.monotonic(), 5 * SLACK_S)[0].decode()
        assert text.startswith("HTTP/1.1 200 ") and "data: [DONE]" in text, text[-300:]


def test_uvicorn_config_carries_the_connection_settings() -> None:
    server = ServerConfig(keep_alive_timeout_s=0.25, max_connections=7)
    config = uvicorn_config(create_app(FakeEngine(), server), Config(server=server))
    assert config.timeout_keep_alive == 0.25
    assert config.limit_concurrency == 8  # uvicorn counts the asking connection too
    assert isinstance(config.http, type)
    expected = httptools_protocol() or H11Protocol
    assert issubclass(config.http, expected)
    assert config.http.header_timeout_s == ServerConfig().header_timeout_s  # type: ignore[attr-defined]
    assert config.http.shares.max_connections == 7  # type: ignore[attr-defined]


def test_body_rate_flags_reach_the_server_config() -> None:
    argv = ["serve", "--body-grace-s", "3", "--min-body-rate-bytes-per-s", "64"]
    server = config_from_args(cli.build_parser({}).parse_args(argv)).server
    assert (server.body_grace_s, server.min_body_rate_bytes_per_s) == (3.0, 64.0)
    with pytest.raises(ConfigError, match="min_body_rate_bytes_per_s must be positive"):
        ServerConfig(min_body_rate_bytes_per_s=0)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A loop for a protocol built outside a server (else uvicorn makes one nobody closes)."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def make_protocol(cls: type[asyncio.Protocol], loop: asyncio.AbstractEventLoop) -> Any:
    """A protocol as uvicorn's server makes one (fails loudly if that signature changes)."""
    config = uvicorn.Config(create_app(FakeEngine()), loop="none", log_config=None)
    return cls(config=config, server_state=ServerState(), app_state={}, _loop=loop)  # type: ignore[call-arg]


def assert_hooks_exist(ours: type, base: type) -> None:
    """Every public method our protocol overrides is one uvicorn's protocol still has (those of
    `SharedConnection` are our own)."""
    own = {"is_stalled", "evict"}
    assert own <= set(dir(SharedConnection))
    hooks = [
        n
        for n, value in vars(ours).items()
        if callable(value) and not n.startswith("_") and n not in own
    ]
    assert hooks, ours
    for name in hooks:
        assert callable(getattr(base, name, None)), f"uvicorn's {base.__name__} lost {name}"


def test_hooked_h11_internals_exist(loop: asyncio.AbstractEventLoop) -> None:
    assert_hooks_exist(H11HeadTimeoutProtocol, H11Protocol)
    protocol = make_protocol(H11HeadTimeoutProtocol, loop)
    assert protocol.conn.their_state is h11.IDLE
    assert protocol.loop is loop


def test_hooked_httptools_internals_exist(loop: asyncio.AbstractEventLoop) -> None:
    pytest.importorskip("httptools")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    ours = httptools_protocol()
    assert ours is not None and http_protocol(1.0, 8).__mro__[1] is ours
    assert_hooks_exist(ours, HttpToolsProtocol)
    protocol = make_protocol(ours, loop)
    assert not protocol.pipeline and protocol.loop is loop
