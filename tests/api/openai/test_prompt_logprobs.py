"""`echo`, `prompt_logprobs` and `include_stop_str_in_output` on the wire, through the official
openai SDK, over the fake engine (its prompt token i + 1 scores -0.25 * (i + 1), the most
likely at its position, then the ids after it; its reply is `REPLY`, one character a token)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.api.fake_engine import REPLY, FakeEngine
from tests.api.live_server import LiveServer

PROMPT = "Score me"
OFFSET = 3
"""The fake tokenizer's id of character c is ord(c) + OFFSET."""


@pytest.fixture(scope="module")
def client(fake_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=fake_server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def _fake_logprob(i: int) -> float:
    """The fake engine's score of prompt token i (i >= 1)."""
    return -0.25 * i


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    r = client.completions.create(model="m", prompt=PROMPT, echo=True, max_tokens=5)
    assert r.choices[0].text == PROMPT + REPLY[:5]
    by_ids = client.completions.create(model="m", prompt=_ids(PROMPT), echo=True, max_tokens=5)
    assert by_ids.choices[0].text == PROMPT + REPLY[:5]


def test_echo_with_logprobs_scores_the_prompt_first(client: openai.OpenAI) -> None:
    r = client.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=2, max_tokens=3)
    choice = r.choices[0]
    assert choice.text == PROMPT + REPLY[:3]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.tokens == list(PROMPT + REPLY[:3])
    assert lp.text_offset == list(range(len(PROMPT) + 3))
    n = len(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == [_fake_logprob(i) for i in range(1, n)]
    for i in range(1, n):
        want = {PROMPT[i]: _fake_logprob(i), chr(ord(PROMPT[i]) + 1): _fake_logprob(i) - 1}
        assert lp.top_logprobs[i] == want
    assert lp.token_logprobs[n:] == [-0.5] * 3  # the fake's generated tokens


def test_max_tokens_zero_returns_the_prompt_scores_alone(client: openai.OpenAI) -> None:
    r = client.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.tokens == list(PROMPT)
    assert choice.logprobs.top_logprobs is not None
    assert choice.logprobs.top_logprobs[1] == {PROMPT[1]: _fake_logprob(1)}
    assert r.usage is not None and r.usage.completion_tokens == 0
    assert r.usage.prompt_tokens == len(PROMPT)


def test_batched_prompts_each_echo_their_own(client: openai.OpenAI) -> None:
    """lm-evaluation-harness's request: token-id prompts in a batch, temperature 0, one token."""
    prompts = [_ids("ab"), _ids("xyz")]
    r = client.completions.create(
        model="m", prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    assert [c.text for c in r.choices] == ["ab" + REPLY[0], "xyz" + REPLY[0]]
    for choice, n in zip(r.choices, (2, 3), strict=True):
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        assert len(choice.logprobs.token_logprobs) == n + 1


def test_echo_streamed_equals_whole(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=1, max_tokens=4)
    stream = client.completions.create(
        model="m", prompt=PROMPT, echo=True, logprobs=1, max_tokens=4, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    tokens: list[str] = []
    offsets: list[int] = []
    for c in chunks:
        lp = c.choices[0].logprobs if c.choices else None
        if lp is not None:
            tokens += lp.tokens or []
            offsets += lp.text_offset or []
    assert whole.choices[0].logprobs is not None
    assert tokens == whole.choices[0].logprobs.tokens
    assert offsets == whole.choices[0].logprobs.text_offset


def test_streamed_max_tokens_zero(fake_server: LiveServer) -> None:
    body = {"prompt": PROMPT, "echo": True, "max_tokens": 0, "stream": True}
    with httpx.stream("POST", fake_server.url + "/v1/completions", json=body, timeout=30) as r:
        datas = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    choices = [json.loads(d)["choices"][0] for d in datas[:-1]]
    assert "".join(c["text"] for c in choices) == PROMPT
    assert choices[-1]["finish_reason"] == "length"


def _vllm_entries(ids: list[int], k: int) -> list[Any]:
    """What vLLM's `prompt_logprobs` holds for the fake engine's scores of prompt `ids`."""
    decode = FakeEngine().tokenizer.decode
    out: list[Any] = [None]
    for i in range(1, len(ids)):
        lp = _fake_logprob(i)
        entry = {
            str(ids[i] + j): {
                "logprob": lp - j,
                "rank": 1 + j,
                "decoded_token": decode([ids[i] + j]),
            }
            for j in range(max(k, 1))
        }
        out.append(entry)
    return out


def _ids(text: str) -> list[int]:
    return [ord(c) + OFFSET for c in text]


def test_prompt_logprobs_on_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    assert r.choices[0].text == REPLY[:2]
    assert r.choices[0].model_extra is not None
    assert r.choices[0].model_extra["prompt_logprobs"] == _vllm_entries(_ids(PROMPT), 2)
    plain = client.completions.create(model="m", prompt=PROMPT, max_tokens=2)
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})


def test_prompt_logprobs_on_chat(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(
        model="m", messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    assert r.model_extra is not None
    assert r.model_extra["prompt_logprobs"] == _vllm_entries(
        fake_engine.recipe.encode(_chat("hi")), 0
    )
    assert fake_engine.last_params is not None and fake_engine.last_params.prompt_logprobs == 0


def _chat(text: str) -> Any:
    from deepinfer.text.recipe import ChatMessage

    return [ChatMessage("user", text)]


def test_include_stop_str_in_output(client: openai.OpenAI) -> None:
    stop, cut = "there", REPLY.index("there") + len("there")
    for extra, want in (({"include_stop_str_in_output": True}, REPLY[:cut]), ({}, REPLY[:6])):
        r = client.completions.create(
            model="m", prompt="x", stop=[stop], max_tokens=100, extra_body=extra
        )
        assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
        ),
    ],
)
def test_bad_prompt_scoring_requests_are_400(
    fake_server: LiveServer, path: str, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(fake_server.url + path, json={"model": "m", **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
