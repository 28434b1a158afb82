"""Expected events are not server errors: a client leaving mid-body and a missing static file are
logged in one short line at most (no traceback, nothing at ERROR) and counted in `/metrics`
under their own status (499, 404), never as a 500."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from starlette.applications import Starlette

from deepinfer.api.app import create_app
from deepinfer.server_config import ServerConfig
from tests.api.fake_engine import FakeEngine
from tests.api.live_server import LiveServer

KEY = "k-123"


@pytest.fixture(scope="module")
def keyed() -> Iterator[LiveServer]:
    live = LiveServer(create_app(FakeEngine(), ServerConfig(api_key=KEY))).start()
    try:
        yield live
    finally:
        live.stop()


def request_counts(live: LiveServer) -> dict[tuple[str, str], float]:
    """`deepinfer_requests_total` by (endpoint, status)."""
    app = live.config.app
    assert isinstance(app, Starlette)
    counts = {}
    for sample in app.state.metrics.requests.collect()[0].samples:
        if sample.name.endswith("_total"):
            counts[sample.labels["endpoint"], sample.labels["status"]] = sample.value
    return counts


def wait_for_count(live: LiveServer, endpoint: str, status: str, before: float) -> None:
    deadline_s = time.monotonic() + 5
    while request_counts(live).get((endpoint, status), 0) <= before:
        assert time.monotonic() < deadline_s, f"no {status} counted for {endpoint}"
        time.sleep(0.02)


def assert_quiet(records: list[logging.LogRecord]) -> None:
    """Nothing at ERROR or above, and no traceback at any level."""
    loud = [r for r in records if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/tokenize"])
def test_client_leaving_mid_body_is_one_short_line_and_no_server_error(
    keyed: LiveServer, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    endpoint = path
    before = request_counts(keyed).get((endpoint, "499"), 0)
    caplog.set_level(logging.INFO)
    sock = socket.create_connection(("127.0.0.1", keyed.port), timeout=5)
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\n"
    sock.sendall(f"{head}Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{".encode())
    time.sleep(0.2)  # the route is reading the body
    sock.close()
    wait_for_count(keyed, endpoint, "499", before)
    assert_quiet(caplog.records)
    lines = [r.getMessage() for r in caplog.records if "disconnected mid-body" in r.getMessage()]
    assert len(lines) == 1 and path in lines[0] and "\n" not in lines[0], lines
    assert not any(status == "500" for _, status in request_counts(keyed))


def test_missing_static_file_is_a_plain_404(
    keyed: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    r = httpx.get(keyed.url + "/static/nope.js")  # served without the key
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "no such file: /static/nope.js"
    wait_for_count(keyed, "other", "404", 0)
    assert_quiet(caplog.records)
    assert not any(status == "500" for _, status in request_counts(keyed))
