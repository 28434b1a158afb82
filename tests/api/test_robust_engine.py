"""One request never takes the live server down (real engine on SmolLM2): parameters that
broke float32 sampling are refused or served soundly, and a fault injected into one request's
forward pass answers that request with a 500 (or an error event) in its API's envelope while a
concurrent request completes and `/health` stays 200."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from deepinfer.request import FinishReason, SamplingParams
from deepinfer.text.recipe import ChatMessage
from tests.api.live_server import LiveServer

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
MARKER = "Zebra-quokka fault marker"


@pytest.fixture(scope="module")
def engine(real_server: LiveServer) -> Any:
    return real_server.config.app.state.engine


@pytest.fixture(scope="module")
def client(real_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=real_server.url, timeout=120) as c:
        yield c


def _chat(client: httpx.Client, content: str = QUESTION, **fields: Any) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **fields}
    return client.post("/v1/chat/completions", json=body)


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def _healthy(client: httpx.Client, reference: str) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert _text(_chat(client, max_tokens=12, temperature=0)) == reference


def test_unsound_sampling_values_never_kill_the_engine(
    real_server: LiveServer, client: httpx.Client, engine: Any
) -> None:
    reference = _text(_chat(client, max_tokens=12, temperature=0))
    refused = _chat(client, max_tokens=8, repetition_penalty=1e-40)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "repetition_penalty" and "[0.01, 100" in error["message"]
    _healthy(client, reference)
    # a tiny temperature is greedy, not an overflow
    assert _text(_chat(client, max_tokens=12, temperature=1e-30)) == reference
    every_id = list(range(engine.tokenizer.vocab_size))
    for min_tokens in (0, 2):
        r = _chat(client, max_tokens=8, stop_token_ids=every_id, min_tokens=min_tokens)
        if r.status_code == 400:  # the server's limit on stop token ids
            assert r.json()["error"]["param"] == "stop_token_ids"
        else:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == min_tokens + 1
        _healthy(client, reference)
    # past the API's limits: the engine itself, every id suppressed for two tokens (they
    # come from the unsuppressed logits), then any id stops
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            max_tokens=8, temperature=temperature, seed=7, stop_token_ids=tuple(every_id),
            min_tokens=2,
        )  # fmt: skip
        outputs = _generate(real_server, engine, QUESTION, params)
        token_ids = [t for out in outputs for t in out.token_ids]
        assert len(token_ids) == 3 and all(0 <= t < len(every_id) for t in token_ids)
        assert outputs[-1].finish_reason is FinishReason.STOP
        if temperature == 0.0:
            assert "".join(out.text for out in outputs) == _text(
                _chat(client, max_tokens=2, temperature=0)
            )
        _healthy(client, reference)


def _generate(server: LiveServer, engine: Any, question: str, params: SamplingParams) -> list[Any]:
    """The engine's outputs for a chat question, run on the server's loop."""

    async def run() -> list[Any]:
        messages = [ChatMessage("user", question)]
        return [out async for out in engine.generate(messages, params)]

    assert server.loop is not None
    return asyncio.run_coroutine_threadsafe(run(), server.loop).result(timeout=60)


def _inject_fault(server: LiveServer, engine: Any) -> None:
    """Every step holding a prompt that contains `MARKER`'s tokens raises on the worker."""
    needle = engine.tokenizer.encode(MARKER)

    def holds_marker(ids: list[int]) -> bool:
        n = len(needle)
        return any(ids[i : i + n] == needle for i in range(len(ids) - n + 1))

    def patch() -> None:
        core = engine.core
        for runner in {id(r): r for r in (core.runner, core.decode_runner)}.values():
            execute = runner.execute

            def raising(so: Any, execute: Any = execute) -> Any:
                if any(holds_marker(c.request.prompt_token_ids) for c in so.chunks):
                    raise RuntimeError("injected fault")
                return execute(so)

            runner.execute = raising

    server.call(patch)


def _restore(server: LiveServer, engine: Any) -> None:
    def restore() -> None:
        core = engine.core
        for runner in (core.runner, core.decode_runner):
            vars(runner).pop("execute", None)

    server.call(restore)


def _sse_payloads(response: httpx.Response) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) of each frame; `[DONE]` as the string itself."""
    frames = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        event, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                raw = line[len("data: ") :]
                data = raw if raw == "[DONE]" else json.loads(raw)
        frames.append((event, data))
    return frames


def test_injected_fault_fails_one_request_only(
    real_server: LiveServer, client: httpx.Client, engine: Any
) -> None:
    long_fields: dict[str, Any] = {"max_tokens": 64, "temperature": 0, "ignore_eos": True}
    reference = _text(_chat(client, "Tell me a story about a cat.", **long_fields))
    failed_before = real_server.call(engine.stats).num_failed_requests
    _inject_fault(real_server, engine)
    try:
        started, texts = threading.Event(), []

        def concurrent() -> None:
            body = {
                "model": "m", "stream": True, **long_fields,
                "messages": [{"role": "user", "content": "Tell me a story about a cat."}],
            }  # fmt: skip
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        texts.append(delta.get("content") or "")
                        if texts[-1]:
                            started.set()

        thread = threading.Thread(target=concurrent)
        thread.start()
        assert started.wait(60), "the concurrent request never started decoding"
        faulty = f"{MARKER}: {QUESTION}"
        oai = _chat(client, faulty, max_tokens=8)
        assert oai.status_code == 500
        assert oai.json()["error"]["type"] == "internal_error"
        assert "RuntimeError" in oai.json()["error"]["message"]
        body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": faulty}]}
        ant = client.post("/v1/messages", json=body)
        assert ant.status_code == 500
        assert ant.json()["type"] == "error" and ant.json()["error"]["type"] == "api_error"
        stream = _chat(client, faulty, max_tokens=8, stream=True)
        frames = _sse_payloads(stream)
        assert stream.status_code == 200 and frames[-1] == (None, "[DONE]")
        assert frames[-2][1]["error"]["type"] == "internal_error"
        ant_stream = client.post("/v1/messages", json={**body, "stream": True})
        event, payload = _sse_payloads(ant_stream)[-1]
        assert event == "error" and payload["error"]["type"] == "api_error"
        assert client.get("/health").json() == {"status": "ok"}
        assert thread.is_alive(), "the faults were meant to overlap the concurrent request"
        thread.join(120)
        assert "".join(texts) == reference
        assert real_server.call(engine.stats).num_failed_requests == failed_before + 4
    finally:
        _restore(real_server, engine)
    assert client.get("/health").json() == {"status": "ok"}
    assert _text(_chat(client, f"{MARKER}: {QUESTION}", max_tokens=4, temperature=0))
    real_server.call(engine.check_integrity)
