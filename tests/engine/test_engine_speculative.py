"""Speculative decoding (`--speculative ngram`) through the engine: the same greedy tokens as
plain decoding, on the tiny random model and on the real one, alone and batched, with the
drafts counted in the engine's stats and `/metrics` names."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from conftest import real_config
from tiny_engine import run_all, tiny_config

from deepinfer.config import Config, SpeculativeConfig, WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.request import SamplingParams
from deepinfer.text.recipe import ChatMessage

NGRAM = SpeculativeConfig(speculative="ngram")


def _with_ngram(config: Config, num_draft_tokens: int = 5) -> Config:
    spec = dataclasses.replace(NGRAM, num_draft_tokens=num_draft_tokens)
    return config.replace(speculative=spec)


def _repetitive_prompts() -> list[list[int]]:
    """Token prompts that repeat themselves (prompt lookup finds matches at once)."""
    base = [[(i * 53 + j * 7) % 3000 + 200 for j in range(3 + i % 5)] for i in range(8)]
    return [b * (2 + i % 3) + b[: i % 3] for i, b in enumerate(base)]


@pytest.mark.parametrize("num_draft_tokens", [1, 5])
async def test_tiny_model_gives_the_plain_tokens(
    tiny_llama_dir: Path, num_draft_tokens: int
) -> None:
    config = tiny_config(tiny_llama_dir, WorkersConfig(), num_blocks=160)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = _repetitive_prompts()
    async with AsyncEngine(config) as plain:
        want = await run_all(plain, prompts, params)
    async with AsyncEngine(_with_ngram(config, num_draft_tokens)) as engine:
        together = await run_all(engine, prompts, params)
        alone = [(await run_all(engine, [p], params))[0] for p in prompts[:3]]
        counts = engine.stats().speculative
        engine.check_integrity()
        assert engine.stats().num_blocks_used == 0
    assert together == want
    assert alone == want[:3]
    assert counts.proposer == "ngram" and counts.num_drafted > 0 and counts.num_verified > 0
    assert counts.num_accepted <= counts.num_drafted


async def _greedy(engine: AsyncEngine, prompt: object, max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ids: list[int] = []
    async for out in engine.generate(prompt, params):  # type: ignore[arg-type]
        ids.extend(out.token_ids)
    return ids


CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
REAL_PROMPTS = [
    [ChatMessage("user", f"Here is a file:\n{CODE}\nRewrite it exactly, then add a function mul.")],
    [ChatMessage("user", "Count from 1 to 25, separated by commas.")],
    [ChatMessage("user", "Write a short paragraph about trains, then list 3 facts about rain.")],
    "The quick brown fox jumps over the lazy dog. " * 4,
]


@pytest.mark.slow
async def test_real_model_gives_the_plain_tokens(real_engine: AsyncEngine) -> None:
    """Against the session's plain engine, on the same settings but `--speculative ngram`:
    alone and four at once, the same tokens; and drafts were accepted."""
    want = [await _greedy(real_engine, p, 64) for p in REAL_PROMPTS]
    async with AsyncEngine(_with_ngram(real_config())) as engine:
        alone = [await _greedy(engine, p, 64) for p in REAL_PROMPTS]
        together = await asyncio.gather(*(_greedy(engine, p, 64) for p in REAL_PROMPTS))
        counts = engine.stats().speculative
        engine.check_integrity()
    assert alone == want
    assert list(together) == want
    assert counts.num_accepted > 0, counts
