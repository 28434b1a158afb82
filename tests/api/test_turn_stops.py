"""Chat answers stop at the recipe's turn stops (a template-less transcript's next-turn label):
over the fake engine for every chat route, and over Gemma 3 270M base (slow), pulled and named
by its `deepinfer pull` name. Raw completions are left alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from deepinfer.api.app import create_app
from deepinfer.config import CacheConfig, Config, DiskCacheConfig, ModelConfig
from deepinfer.environment import default_model_dir
from deepinfer.request import SamplingParams
from deepinfer.text.recipe import PlainRecipe
from tests.api.fake_engine import FakeEngine
from tests.api.live_server import LiveServer

ANSWER = " Paris."
REPLY = ANSWER + "\n\nUser: And of Spain?\n\nAssistant: Madrid."
QUESTION = [{"role": "user", "content": "The capital of France?"}]
GEMMA3 = default_model_dir() / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"


@pytest.fixture(scope="module")
def transcript_server() -> Iterator[LiveServer]:
    engine = FakeEngine()
    engine.recipe.turn_stops = PlainRecipe.turn_stops
    engine.reply = REPLY
    server = LiveServer(create_app(engine)).start()
    try:
        yield server
    finally:
        server.stop()


def test_the_plain_recipe_stops_at_each_label() -> None:
    params = SamplingParams(stop=("END",)).with_turn_stops(PlainRecipe.turn_stops)
    assert params.stop[0] == "END" and {"\n\nUser:", "\nUser:"} <= set(params.stop)
    assert SamplingParams(ignore_eos=True).with_turn_stops(PlainRecipe.turn_stops).stop == ()


def test_every_chat_route_stops_at_the_next_turn(transcript_server: LiveServer) -> None:
    url = transcript_server.url
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as oai:
        chat = oai.chat.completions.create(model="m", messages=QUESTION, max_tokens=200)  # type: ignore[arg-type]
        assert chat.choices[0].message.content == ANSWER
        assert chat.choices[0].finish_reason == "stop"
        streamed = oai.chat.completions.create(
            model="m",
            messages=QUESTION,
            max_tokens=200,
            stream=True,  # type: ignore[arg-type]
        )
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == ANSWER
        response = oai.responses.create(model="m", input="The capital of France?")
        assert response.output_text == ANSWER and response.status == "completed"
        raw = oai.completions.create(model="m", prompt="User: hi\n\nAssistant:", max_tokens=200)
        assert raw.choices[0].text == REPLY  # a raw prompt is no transcript of ours
    with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0) as claude:
        m = claude.messages.create(model="m", max_tokens=200, messages=QUESTION)  # type: ignore[arg-type]
        assert m.content[0].text == ANSWER  # type: ignore[union-attr]
        assert m.stop_reason == "end_turn" and m.stop_sequence is None
        m = claude.messages.create(
            model="m",
            max_tokens=200,
            messages=QUESTION,
            stop_sequences=["Madrid"],  # type: ignore[arg-type]
        )
        assert m.content[0].text == ANSWER and m.stop_reason == "end_turn"  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.skipif(not GEMMA3.is_file(), reason="run `deepinfer pull gemma3-270m`")
def test_gemma3_base_answers_one_turn(tmp_path: Path) -> None:
    """The base model, named as pulled, writes one answer and stops where it would begin the
    user's next turn; the same transcript as a raw completion goes on past it."""
    config = Config(
        model=ModelConfig(path=Path("gemma3-270m")),
        cache=CacheConfig(num_blocks=256),
        disk_cache=DiskCacheConfig(enabled=False, cache_dir=tmp_path),
    )
    from deepinfer.engine.async_engine import AsyncEngine

    server = LiveServer(create_app(AsyncEngine(config), config.server)).start(timeout_s=300)
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as oai:
            chat = oai.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=64,
                temperature=0.0,
            )
            raw = oai.completions.create(
                model="m", prompt="User: What is the capital of France?\n\nAssistant:",
                max_tokens=64, temperature=0.0,
            )  # fmt: skip
    finally:
        server.stop()
    answer = chat.choices[0].message.content or ""
    assert chat.choices[0].finish_reason == "stop", answer
    assert answer.strip() and "User:" not in answer and not answer.endswith("\n")
    assert chat.usage is not None and chat.usage.completion_tokens < 64
    assert raw.choices[0].text.startswith(answer) and "\nUser:" in raw.choices[0].text
