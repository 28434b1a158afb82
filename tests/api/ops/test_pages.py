"""The web pages as HTTP sees them: served with a strict CSP, open without the API key (they
hold no data) while everything they call needs it, cacheable by ETag, absent with `--no-web`,
and shipped in the package (every file a page names is served)."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path

import httpx
import pytest

from deepinfer.api.app import create_app
from deepinfer.api.ops.pages import CONTENT_SECURITY_POLICY, load_static
from deepinfer.server_config import ServerConfig
from tests.api.fake_engine import FakeEngine
from tests.api.live_server import LiveServer

KEY = "sk-pages-test"


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[LiveServer]:
    server = LiveServer(create_app(FakeEngine(), ServerConfig(api_key=KEY))).start()
    try:
        yield server
    finally:
        server.stop()


def test_pages_are_open_and_strict_while_data_needs_the_key(keyed_server: LiveServer) -> None:
    for path, marker in (("/", "chat.js"), ("/dashboard", "dashboard.js")):
        page = httpx.get(keyed_server.url + path)
        assert page.status_code == 200
        assert page.headers["content-type"] == "text/html; charset=utf-8"
        assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert page.headers["x-content-type-options"] == "nosniff"
        assert marker in page.text
        assert "<style" not in page.text and " style=" not in page.text
        assert not re.search(r"<script(?![^>]*\bsrc=)", page.text), "inline script"
        assert not re.search(r"""(src|href)=["'](https?:)?//""", page.text), "not this origin"
    for path in ("/v1/stats", "/v1/models", "/metrics"):
        assert httpx.get(keyed_server.url + path).status_code == 401
        headers = {"authorization": f"Bearer {KEY}"}
        assert httpx.get(keyed_server.url + path, headers=headers).status_code == 200


@pytest.mark.slow
def test_every_file_a_page_names_is_served_and_cacheable(keyed_server: LiveServer) -> None:
    files = load_static()
    assert {"chat.html", "dashboard.html", "common.js", "app.css"} <= files.keys()
    named: set[str] = set()
    for text in (f.body.decode() for f in files.values()):
        named |= set(re.findall(r"""static/([\w.-]+)""", text))
        named |= set(re.findall(r"""from ["']\./([\w.-]+)["']""", text))  # module imports
    assert named <= files.keys(), named - files.keys()
    for name in sorted(named):
        r = httpx.get(f"{keyed_server.url}/static/{name}")
        assert r.status_code == 200 and r.content == files[name].body
        again = httpx.get(
            f"{keyed_server.url}/static/{name}", headers={"if-none-match": r.headers["etag"]}
        )
        assert again.status_code == 304 and not again.content
    missing = httpx.get(f"{keyed_server.url}/static/nope.js")
    assert missing.status_code == 404 and "error" in missing.json()
    assert httpx.get(f"{keyed_server.url}/static/..%2Fpages.py").status_code == 404


def test_every_web_file_ships_in_the_wheel() -> None:
    """pyproject's package data names every file of the web folder (the wheel carries them)."""
    root = Path(__file__).resolve().parents[3]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["deepinfer.api.ops"]
    web = root / "deepinfer" / "api" / "ops" / "web"
    names = [f"web/{p.name}" for p in web.iterdir() if p.is_file()]
    assert names and all(any(fnmatch(n, pat) for pat in patterns) for n in names), names
    assert {n.removeprefix("web/") for n in names} == set(load_static())


def test_no_web_serves_no_pages() -> None:
    server = LiveServer(create_app(FakeEngine(), ServerConfig(web=False, api_key=KEY))).start()
    try:
        for path in ("/", "/dashboard", "/static/common.js"):
            assert httpx.get(server.url + path).status_code == 401  # not a page: the key first
            r = httpx.get(server.url + path, headers={"x-api-key": KEY})
            assert r.status_code == 404
    finally:
        server.stop()
