"""Speculative decoding (`--speculative ngram`) through the engine: the same tokens as plain
decoding (greedy, and seeded sampling), on the tiny random model and on the real one, alone and
batched, with the drafts counted in the engine's stats and `/metrics` names."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from deepinfer.api.ops.metrics import ApiMetrics
from deepinfer.config import Config, SpeculativeConfig, WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.errors import ConfigError
from deepinfer.request import SamplingParams
from deepinfer.text.recipe import ChatMessage
from tests.engine.conftest import real_config
from tests.engine.tiny_engine import run_all, tiny_config

NGRAM = SpeculativeConfig(speculative="ngram")


def _with_ngram(
    config: Config, num_draft_tokens: int = 5, gate: str = "on", method: str = "ngram"
) -> Config:
    """Prompt lookup (or another proposer on the loop: `suffix`, `auto`). The tiny-model tests
    turn the gate off: what the gate drafts depends on the step times it measures, and they
    count drafts."""
    spec = dataclasses.replace(
        NGRAM,
        speculative=method,  # type: ignore[arg-type]
        num_draft_tokens=num_draft_tokens,
        speculative_gate=gate,  # type: ignore[arg-type]
    )
    return config.replace(speculative=spec)


def _with_layers(config: Config, draft_layers: int, gate: str = "off") -> Config:
    """Self-speculation; the gate off by default, so that every step drafts and verifies."""
    spec = SpeculativeConfig(speculative="layers", draft_layers=draft_layers, speculative_gate=gate)  # type: ignore[arg-type]
    return config.replace(speculative=spec)


def _repetitive_prompts() -> list[list[int]]:
    """Token prompts that repeat themselves (prompt lookup finds matches at once)."""
    base = [[(i * 53 + j * 7) % 3000 + 200 for j in range(3 + i % 5)] for i in range(8)]
    return [b * (2 + i % 3) + b[: i % 3] for i, b in enumerate(base)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "num_draft_tokens", "colocated"),
    [
        ("ngram", 1, False),
        ("ngram", 5, False),
        ("ngram", 5, True),
        ("suffix", 5, False),
        ("auto", 5, True),
    ],
)
async def test_tiny_model_gives_the_plain_tokens(
    tiny_llama_dir: Path, method: str, num_draft_tokens: int, colocated: bool
) -> None:
    config = tiny_config(tiny_llama_dir, WorkersConfig(colocated=colocated), num_blocks=160)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = _repetitive_prompts()
    async with AsyncEngine(config) as plain:
        want = await run_all(plain, prompts, params)
    async with AsyncEngine(_with_ngram(config, num_draft_tokens, "off", method)) as engine:
        together = await run_all(engine, prompts, params)
        alone = [(await run_all(engine, [p], params))[0] for p in prompts[:3]]
        counts = engine.stats().speculative
        metrics = ApiMetrics(engine).render().decode()
        engine.check_integrity()
        assert engine.stats().num_blocks_used == 0
    assert together == want
    assert alone == want[:3]
    assert counts.proposer == method and counts.num_drafted > 0 and counts.num_verified > 0
    assert counts.num_accepted <= counts.num_drafted
    lines = metrics.splitlines()
    for name, value in (
        ("drafted", counts.num_drafted),
        ("accepted", counts.num_accepted),
        ("verified", counts.num_verified),
    ):
        assert f'deepinfer_speculative_{name}_total{{proposer="{method}"}} {float(value)}' in lines
    mean = counts.num_accepted / counts.num_verified
    assert f'deepinfer_speculative_mean_accepted_length{{proposer="{method}"}} {mean}' in lines
    # every accepted position was observed, plus at most one rejected one per request-step
    trials = sum(b.num_trials for b in counts.calibration)
    assert counts.num_accepted < trials <= counts.num_accepted + counts.num_verified
    assert f'deepinfer_speculative_gate_trials_total{{bucket="0.5",proposer="{method}"}}' in metrics


SAMPLED = [
    SamplingParams(max_tokens=40, temperature=0.8, top_k=20, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.02, repetition_penalty=1.1, seed=12, min_tokens=30),
    SamplingParams(max_tokens=40, temperature=0.05, presence_penalty=0.5, seed=13, logprobs=1),
]
"""Random output at 0.8 (drafts rarely match), close to the model's repetitive greedy path at
0.02 and 0.05 (they often do)."""


@pytest.mark.slow
@pytest.mark.parametrize("colocated", [False, True])
async def test_tiny_model_sampled_requests_keep_their_seeded_tokens(
    tiny_llama_dir: Path, colocated: bool
) -> None:
    """Seeded sampling with penalties and `min_tokens`: the tokens (and logprobs) plain decoding
    gives, batched, in both worker modes."""
    config = tiny_config(tiny_llama_dir, WorkersConfig(colocated=colocated), num_blocks=160)
    prompts = _repetitive_prompts()[:6]

    async def each(engine: AsyncEngine) -> list[list[int]]:
        runs = [run_all(engine, prompts, p) for p in SAMPLED]
        return [ids for batch in await asyncio.gather(*runs) for ids in batch]

    async with AsyncEngine(config) as plain:
        want = await each(plain)
    async with AsyncEngine(_with_ngram(config, gate="off")) as engine:
        got = await each(engine)
        counts = engine.stats().speculative
        engine.check_integrity()
    assert got == want
    assert counts.num_accepted > 0 and counts.num_accepted < counts.num_drafted


async def _tokens(
    engine: AsyncEngine, prompt: object, max_tokens: int, params: SamplingParams | None = None
) -> list[int]:
    params = params or SamplingParams(max_tokens=max_tokens, temperature=0.0)
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
    alone and four at once, greedy and seeded, the same tokens; and drafts were accepted. In
    colocated mode too (four at once)."""
    want = [await _tokens(real_engine, p, 64) for p in REAL_PROMPTS]
    seeded = SamplingParams(max_tokens=48, temperature=0.7, top_p=0.95, seed=5)
    want_sampled = [await _tokens(real_engine, p, 0, seeded) for p in REAL_PROMPTS]
    async with AsyncEngine(_with_ngram(real_config())) as engine:
        alone = [await _tokens(engine, p, 64) for p in REAL_PROMPTS]
        together = await asyncio.gather(*(_tokens(engine, p, 64) for p in REAL_PROMPTS))
        sampled = await asyncio.gather(*(_tokens(engine, p, 0, seeded) for p in REAL_PROMPTS))
        counts = engine.stats().speculative
        engine.check_integrity()
    assert alone == want
    assert list(together) == want
    assert list(sampled) == want_sampled
    assert counts.num_accepted > 0, counts
    colocated = _with_ngram(real_config().replace(workers=WorkersConfig(colocated=True)))
    async with AsyncEngine(colocated) as engine:
        together = await asyncio.gather(*(_tokens(engine, p, 64) for p in REAL_PROMPTS))
        sampled = await asyncio.gather(*(_tokens(engine, p, 0, seeded) for p in REAL_PROMPTS))
        assert engine.stats().speculative.num_accepted > 0
        engine.check_integrity()
    assert list(together) == want
    assert list(sampled) == want_sampled


@pytest.mark.slow
@pytest.mark.parametrize("colocated", [False, True])
async def test_tiny_model_self_speculation_gives_the_plain_tokens(
    tiny_llama_dir: Path, colocated: bool
) -> None:
    """`--speculative layers` (its first layer of two drafts): greedy and seeded sampling, the
    plain tokens, in both worker modes; drafts made and some accepted."""
    config = tiny_config(tiny_llama_dir, WorkersConfig(colocated=colocated), num_blocks=160)
    prompts = _repetitive_prompts()[:6]
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

    async def each(engine: AsyncEngine) -> list[list[int]]:
        runs = [run_all(engine, prompts, p) for p in (greedy, *SAMPLED[1:])]
        return [ids for batch in await asyncio.gather(*runs) for ids in batch]

    async with AsyncEngine(config) as plain:
        want = await each(plain)
    async with AsyncEngine(_with_layers(config, 1)) as engine:
        got = await each(engine)
        counts = engine.stats().speculative
        engine.check_integrity()
        assert engine.stats().num_blocks_used == 0
    assert got == want
    assert counts.proposer == "layers"
    assert 0 < counts.num_accepted < counts.num_drafted


async def test_self_speculation_needs_fewer_draft_layers_than_the_model(
    tiny_llama_dir: Path,
) -> None:
    config = _with_layers(tiny_config(tiny_llama_dir, WorkersConfig()), 2)
    with pytest.raises(ConfigError, match=r"draft_layers must be in \[1, 1\]"):
        async with AsyncEngine(config):
            pass


@pytest.mark.slow
async def test_real_model_self_speculation_gives_the_plain_tokens(real_engine: AsyncEngine) -> None:
    """`--speculative layers` on SmolLM2 (its first 8 layers of 30 draft, every draft verified):
    greedy and seeded, alone and together, the plain tokens."""
    seeded = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.95, seed=5)
    want = [await _tokens(real_engine, p, 32) for p in REAL_PROMPTS]
    want_sampled = [await _tokens(real_engine, p, 0, seeded) for p in REAL_PROMPTS]
    async with AsyncEngine(_with_layers(real_config(), 8)) as engine:
        alone = [await _tokens(engine, p, 32) for p in REAL_PROMPTS]
        sampled = await asyncio.gather(*(_tokens(engine, p, 0, seeded) for p in REAL_PROMPTS))
        counts = engine.stats().speculative
        engine.check_integrity()
    assert alone == want
    assert list(sampled) == want_sampled
    assert counts.num_accepted > 0, counts


@pytest.mark.slow
async def test_tiny_model_stop_strings_end_where_plain_decoding_ends(tiny_llama_dir: Path) -> None:
    """A stop string inside a verified run: the same text, tokens, finish and usage as plain
    decoding (the run's tokens after the stop are neither output nor counted)."""
    config = tiny_config(tiny_llama_dir, WorkersConfig(), num_blocks=160)
    prompts = _repetitive_prompts()[:4]
    base = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def outputs(
        engine: AsyncEngine, prompt: list[int], params: SamplingParams
    ) -> tuple[object, ...]:
        text, ids, last = "", list[int](), None
        async for out in engine.generate(prompt, params):
            text, ids, last = text + out.text, ids + list(out.token_ids), out
        assert last is not None
        usage = last.usage  # cached tokens differ: the plain engine saw each prompt before
        return text, ids, last.finish_reason, last.stop_reason, usage.completion_tokens

    async with AsyncEngine(config) as plain:
        full = [(await outputs(plain, p, base))[0] for p in prompts]
        stops = [dataclasses.replace(base, stop=(t[len(t) // 2 : len(t) // 2 + 3],)) for t in full]
        want = [await outputs(plain, p, s) for p, s in zip(prompts, stops, strict=True)]
    async with AsyncEngine(_with_ngram(config, gate="off")) as engine:
        got = [await outputs(engine, p, s) for p, s in zip(prompts, stops, strict=True)]
        counts = engine.stats().speculative
    assert got == want
    assert all(w[3] is not None for w in want)  # every request ended at its stop string
    assert counts.num_accepted > 0
