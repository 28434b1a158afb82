"""`--model null`: the whole serving path over a forward pass that costs nothing. Its greedy
output is plain words of the default model's vocabulary, a function of the prompt alone (the
same alone, in a batch, or again from the prefix cache), and it streams through the official
OpenAI client like any model."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deepinfer.api.app import create_app
from deepinfer.config import CacheConfig, Config, DiskCacheConfig, ModelConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.errors import ModelLoadError
from deepinfer.model.loading.loader import load_model
from deepinfer.request import SamplingParams
from tests.api.live_server import LiveServer

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
WORDS = re.compile(r"^( [a-z]{2,9})+$")


def _config() -> Config:
    return Config(
        model=ModelConfig(path=Path("null")),
        cache=CacheConfig(kv_memory_bytes=64 << 20),
        disk_cache=DiskCacheConfig(enabled=False),
    )


async def _text(engine: AsyncEngine, prompt: str) -> tuple[str, int]:
    """The answer's text and the prompt tokens served from cache."""
    parts: list[str] = []
    cached = 0
    async for out in engine.generate(prompt, GREEDY):
        parts.append(out.text)
        cached = out.usage.cached_tokens
    return "".join(parts), cached


async def test_answers_are_words_and_a_function_of_the_prompt() -> None:
    prompts = [
        f"Question {i}: what is {i} squared, in words? " * (2 + i % 3) + f"#{i}" for i in range(12)
    ]
    async with AsyncEngine(_config()) as engine:
        assert engine.core.info.model_name == "null"
        alone = [await _text(engine, p) for p in prompts]
        together = await asyncio.gather(*(_text(engine, p) for p in prompts))
        engine.check_integrity()
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert all(cached > 0 for _, cached in together)  # the second time, from the prefix cache
    for text, _ in alone:
        assert WORDS.match(text), text
    assert len({t for t, _ in alone}) == len(prompts)  # prompts ending apart answer apart


def test_a_missing_vocabulary_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="vocabulary file"):
        load_model(Path(f"null:{tmp_path / 'missing.gguf'}"), torch.float32, "cpu")


@pytest.fixture(scope="module")
def null_server() -> Iterator[LiveServer]:
    config = _config()
    server = LiveServer(create_app(AsyncEngine(config), config.server)).start(timeout_s=120)
    try:
        yield server
    finally:
        server.stop()


def test_streams_through_the_openai_client(null_server: LiveServer) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{null_server.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Name three colours."}]
    stream = client.chat.completions.create(
        model="null", messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 16
    whole = client.chat.completions.create(
        model="null", messages=messages, max_tokens=16, temperature=0
    )
    assert whole.choices[0].message.content == text
    assert WORDS.match(text), text


def test_logits_hold_one_word_per_row_across_steps() -> None:
    """The logits buffer is reused from step to step: each step's rows still hold exactly their
    own word, whatever the previous step's rows were."""
    null = load_model(Path("null"), torch.float32, "cpu").model
    for rows in (5, 70, 3, 70, 1):
        hidden = torch.randint(0, 1000, (rows, 1)).float()
        logits = null.compute_logits(hidden)
        assert logits.shape == (rows, null.arch.vocab_size)
        assert bool(((logits != 0).sum(dim=1) == 1).all())
        assert logits.argmax(dim=1).tolist() == null.compute_logits(hidden).argmax(dim=1).tolist()
