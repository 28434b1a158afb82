"""The chat playground and the dashboard in headless Chromium, against live servers: text
streams in, the stop button aborts the request on the server, a second turn reads cached
tokens, an answer carrying markup is shown as text, the dashboard's numbers move under load,
and with `--api-key` both pages ask for the key and then work. No page logs an error or a CSP
violation."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from deepinfer.api.app import create_app
from deepinfer.server_config import ServerConfig
from tests.api.fake_engine import FakeEngine
from tests.api.live_server import LiveServer

KEY = "sk-browser-test"


def stats(server: LiveServer, key: str | None = None) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{server.url}/v1/stats", headers=headers, timeout=10).json()


def wait_until(check: Any, timeout_s: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def send(page: Any, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")


def answer_stats(page: Any, index: int) -> dict[str, int]:
    """The usage figures of the `index`-th answer, once its stream has ended."""
    element = page.locator(".message.assistant .answer-stats").nth(index)
    element.and_(page.locator("[data-completion-tokens]")).wait_for()
    names = ("prompt-tokens", "completion-tokens", "cached", "cached-device", "cached-disk")
    return {n: int(element.get_attribute(f"data-{n}")) for n in names}


@pytest.mark.slow
def test_chat_streams_and_stop_aborts_the_request(page: Any, null_server: LiveServer) -> None:
    page.goto(null_server.url + "/")
    page.fill("#max-tokens", "6000")
    before = stats(null_server)["tokens"]["generated"]
    send(page, "Tell me a very long story.")
    content = page.locator(".message.assistant .content").last
    wait_until(lambda: len(content.inner_text()) > 0, what="the first streamed text")
    first = len(content.inner_text())
    wait_until(lambda: len(content.inner_text()) > first, what="more streamed text")
    assert page.locator("#stop").is_enabled()
    page.click("#stop")
    wait_until(lambda: stats(null_server)["running"] == 0, what="the server to abort")
    generated = stats(null_server)["tokens"]["generated"] - before
    assert 0 < generated < 6000  # aborted, not run to max_tokens
    time.sleep(0.5)
    assert stats(null_server)["tokens"]["generated"] - before == generated  # nothing more
    assert "stopped" in page.locator(".message.assistant").last.inner_text().lower()
    # the page keeps working: a next answer streams to its end
    page.fill("#max-tokens", "32")
    send(page, "And a short one.")
    assert answer_stats(page, 1)["completion-tokens"] == 32
    assert page.errors.messages == []


def test_second_turn_reads_cached_tokens(page: Any, null_server: LiveServer) -> None:
    page.goto(null_server.url + "/")
    page.click("#new-chat")
    page.fill("#system", "You are a patient assistant who answers at length.")
    page.fill("#max-tokens", "24")
    send(page, "What is a prefix cache? " * 6)
    first = answer_stats(page, 0)
    send(page, "Say more.")
    second = answer_stats(page, 1)
    assert second["prompt-tokens"] > first["prompt-tokens"]
    assert second["cached"] > first["cached"]
    assert second["cached"] >= first["prompt-tokens"] - 16  # the first turn, but a part block
    assert second["cached-device"] == second["cached"]  # no disk tier here
    # the conversation is kept in local storage: a reload shows both turns
    page.reload()
    page.locator(".message.assistant").nth(1).wait_for()
    assert page.locator(".message.user").count() == 2
    assert page.errors.messages == []


MARKUP = (
    "Here: <script>window.__pwned = 1</script> and "
    '<img src="x" onerror="window.__pwned = 2"> and [a link](javascript:window.__pwned=3) '
    "and **bold**.\n\n```html\n<b>code</b>\n```\n"
)


@pytest.mark.slow
def test_model_markup_is_shown_as_text(page: Any, fake_server: LiveServer) -> None:
    engine = fake_server.config.app.state.engine
    assert isinstance(engine, FakeEngine)
    engine.reply = MARKUP
    try:
        page.goto(fake_server.url + "/")
        page.fill("#max-tokens", "400")
        send(page, "Show me some HTML.")
        answer_stats(page, 0)
        content = page.locator(".message.assistant .content").last
        text = content.inner_text()
        assert "<script>window.__pwned = 1</script>" in text
        assert '<img src="x" onerror="window.__pwned = 2">' in text
        assert "<b>code</b>" in text
        assert content.locator("script, img, b, a[href^=javascript]").count() == 0
        assert content.locator("strong").inner_text() == "bold"
        assert content.locator("pre code").inner_text().strip() == "<b>code</b>"
        assert page.evaluate("window.__pwned") is None
        assert page.errors.messages == []
    finally:
        engine.reply = type(engine)().reply


class Load:
    """Streaming requests against the null model from a few threads, from `start` to `stop`."""

    def __init__(self, server: LiveServer, num_clients: int = 4) -> None:
        self._url = f"{server.url}/v1/chat/completions"
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._client) for _ in range(num_clients)]

    def _client(self) -> None:
        body = {
            "model": "null", "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 400, "stream": True,
        }  # fmt: skip
        with httpx.Client(timeout=30) as http:
            while not self._done.is_set():
                with http.stream("POST", self._url, json=body) as response:
                    for _ in response.iter_bytes():
                        pass

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._done.set()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=30)


@pytest.fixture
def load(null_server: LiveServer) -> Iterator[Load]:
    load = Load(null_server)
    try:
        yield load
    finally:
        load.stop()


def value(page: Any, selector: str) -> float:
    """A dashboard number's raw value (`data-value`; 0 while it has none)."""
    return float(page.locator(selector).get_attribute("data-value") or 0)


@pytest.mark.slow
def test_dashboard_numbers_move_under_load(page: Any, null_server: LiveServer, load: Load) -> None:
    page.goto(null_server.url + "/dashboard")
    page.locator("#running[data-value]").wait_for()
    wait_until(lambda: page.locator("#stream-status").inner_text().strip().lower() == "live")
    assert value(page, "#tokens-out-rate") == 0  # idle
    load.start()
    wait_until(lambda: value(page, "#tokens-out-rate") > 0, what="a token rate")
    wait_until(lambda: value(page, "#running") > 0, what="running requests")
    wait_until(lambda: value(page, "#ttft-p50") > 0, what="a TTFT percentile")
    wait_until(lambda: value(page, "#kv-use") > 0, what="KV blocks in use")
    wait_until(lambda: value(page, "#cache-hit-share") > 0, what="prefix-cache hits")
    load.stop()
    wait_until(lambda: value(page, "#tokens-out-rate") == 0, what="the rate to fall to 0")
    assert value(page, "#running") == 0
    assert page.errors.messages == []


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[LiveServer]:
    server = LiveServer(create_app(FakeEngine(), ServerConfig(api_key=KEY))).start()
    try:
        yield server
    finally:
        server.stop()


def test_pages_ask_for_the_key_then_work(page: Any, keyed_server: LiveServer) -> None:
    page.goto(keyed_server.url + "/dashboard")
    dialog = page.locator("#key-dialog")
    dialog.wait_for(state="visible")
    dialog.locator("input[name=key]").fill(KEY)
    dialog.locator("input[name=key]").press("Enter")
    page.locator("#running[data-value]").wait_for()
    page.goto(keyed_server.url + "/")  # the key is remembered in this browser
    page.fill("#max-tokens", "16")
    send(page, "Hello?")
    assert answer_stats(page, 0)["completion-tokens"] == 16
    assert not dialog.is_visible()
    # every 401 the pages met was the first, keyless one
    assert page.errors.allowing("401") == []


@pytest.mark.slow
def test_chat_with_the_real_model(page: Any, real_server: LiveServer) -> None:
    """SmolLM2 through the page: the answer kept in local storage is the one the official client
    gets for the same conversation (greedy), and the second turn reads the first from cache."""
    page.goto(real_server.url + "/")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "16")
    question = "Name three colours of the rainbow."
    send(page, question)
    first = answer_stats(page, 0)
    stored = page.evaluate(
        "JSON.parse(localStorage.getItem("
        "'deepinfer.chat.conversation.' + localStorage.getItem('deepinfer.chat.current')))"
    )
    shown = stored["messages"][-1]["content"]
    client = openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="none")
    expected = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": question}], max_tokens=16,
        temperature=0,
    )  # fmt: skip
    assert shown == expected.choices[0].message.content and shown.strip()
    send(page, "And three animals?")
    second = answer_stats(page, 1)
    assert second["cached"] >= first["prompt-tokens"] - 16  # the first turn, but a part block
    assert page.errors.messages == []


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.slow
def test_tool_calls_are_shown(page: Any, null_server: LiveServer) -> None:
    page.goto(null_server.url + "/")
    page.click("#new-chat")
    page.fill("#tools", json.dumps([WEATHER_TOOL]))
    page.select_option("#tool-choice", "required")
    page.fill("#max-tokens", "64")
    send(page, "What is the weather in Paris?")
    answer_stats(page, 0)
    call = page.locator(".message.assistant .tool-call").first
    assert call.locator(".tool-name").inner_text().strip() == "get_weather"
    arguments = json.loads(call.locator("pre.tool-args").inner_text())
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    assert page.errors.messages == []


def test_json_answers_are_pretty_printed(page: Any, fake_server: LiveServer) -> None:
    engine = fake_server.config.app.state.engine
    engine.reply = '{"city": "Paris", "days": [1, 2]}'
    try:
        page.goto(fake_server.url + "/")
        page.select_option("#response-format", "json_object")
        send(page, "Plan a trip as JSON.")
        answer_stats(page, 0)
        code = page.locator(".message.assistant .content pre code").inner_text()
        assert json.loads(code) == {"city": "Paris", "days": [1, 2]}
        assert code.count("\n") >= 3  # indented, one member a line
        assert page.errors.messages == []
    finally:
        engine.reply = type(engine)().reply
