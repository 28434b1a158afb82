"""Paths: a route called with a trailing slash is a 404 in the API's envelope naming the route,
never a redirect (clients re-send POST bodies inconsistently across a 307)."""

from __future__ import annotations

import httpx
import pytest

from tests.api.live_server import LiveServer


@pytest.mark.parametrize(
    ("method", "path", "route"),
    [
        ("POST", "/v1/chat/completions/", "/v1/chat/completions"),
        ("POST", "/v1/completions//", "/v1/completions"),
        ("GET", "/v1/models/", "/v1/models"),
        ("POST", "/v1/messages/", "/v1/messages"),
        ("POST", "/v1/messages/count_tokens/", "/v1/messages/count_tokens"),
    ],
)
def test_trailing_slash_is_a_404_naming_the_route(
    fake_server: LiveServer, method: str, path: str, route: str
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = httpx.request(
        method, fake_server.url + path, json=body if method == "POST" else None, timeout=10
    )
    assert response.status_code == 404
    assert "location" not in response.headers
    payload = response.json()
    if route.startswith("/v1/messages"):
        assert payload["type"] == "error" and payload["error"]["type"] == "not_found_error"
    else:
        assert payload["error"]["type"] == "not_found_error"
    assert payload["error"]["message"] == (
        f"Not Found: {method} {path}; the route is {route} (no trailing slash)"
    )


def test_unknown_path_names_no_route(fake_server: LiveServer) -> None:
    response = httpx.post(fake_server.url + "/v1/nothing/", json={}, timeout=10)
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "Not Found: POST /v1/nothing/"
