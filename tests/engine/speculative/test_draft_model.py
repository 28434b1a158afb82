"""`--speculative draft-model` through the engine: a second model drafts on the worker with KV
of its own in the same blocks; the outputs are plain decoding's, greedy and seeded, in both
worker modes. With the model itself as its draft, nearly every draft is accepted: the draft's
KV (caught up lazily, a bounded number of tokens a step) is right."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from deepinfer.config import Config, SpeculativeConfig, WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.environment import default_model_path
from deepinfer.errors import ConfigError
from deepinfer.request import SamplingParams
from deepinfer.runner import worker_draft
from deepinfer.text.recipe import ChatMessage
from tests.engine.conftest import real_config
from tests.engine.tiny_engine import run_all, tiny_config

GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=30, temperature=0.7, top_k=40, seed=3, ignore_eos=True)


def _with_draft(config: Config, draft: Path, gate: str = "off") -> Config:
    spec = SpeculativeConfig(
        speculative="draft-model",
        draft_model=str(draft),
        speculative_gate=gate,  # type: ignore[arg-type]
    )
    return config.replace(speculative=spec)


def _prompts() -> list[list[int]]:
    """Prompts of 12 to 80 tokens (longer than a small catch-up budget)."""
    return [[(i * 41 + j * 13) % 4000 + 150 for j in range(12 + 17 * (i % 5))] for i in range(6)]


@pytest.mark.slow
@pytest.mark.parametrize(("colocated", "catch_up"), [(False, 256), (True, 256), (False, 7)])
async def test_tiny_model_drafting_for_itself_gives_the_plain_tokens(
    tiny_llama_dir: Path, colocated: bool, catch_up: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_draft, "CATCH_UP_TOKENS", catch_up)
    config = tiny_config(tiny_llama_dir, WorkersConfig(colocated=colocated), num_blocks=160)
    prompts = _prompts()
    async with AsyncEngine(config) as plain:
        want = await run_all(plain, prompts, GREEDY)
        want_seeded = await run_all(plain, prompts, SEEDED)
    async with AsyncEngine(_with_draft(config, tiny_llama_dir)) as engine:
        got = await run_all(engine, prompts, GREEDY)
        counts = engine.stats().speculative
        got_seeded = await run_all(engine, prompts, SEEDED)
        engine.check_integrity()
        assert engine.stats().num_blocks_used == 0
    assert got == want
    assert got_seeded == want_seeded
    assert counts.proposer == "draft-model"
    # the model's own greedy drafts: every one accepted but at near-ties of the logits
    assert counts.num_drafted > 20
    assert counts.num_accepted >= 0.9 * counts.num_drafted, counts


async def test_the_draft_finds_its_kv_of_a_shared_prefix(tiny_llama_dir: Path) -> None:
    """A prompt run again (its prefix from the prefix cache): the draft's KV of its whole blocks
    is found in them, not computed again, and the drafts are as good."""
    config = tiny_config(tiny_llama_dir, WorkersConfig(), num_blocks=160)
    prompt = [(j * 13) % 4000 + 150 for j in range(100)]
    async with AsyncEngine(_with_draft(config, tiny_llama_dir)) as engine:
        core = engine._core
        assert core is not None and core.decode_runner.drafter is not None
        drafter = core.decode_runner.drafter
        first = await run_all(engine, [prompt], GREEDY)
        cold = drafter.num_caught_up
        again = await run_all(engine, [prompt], GREEDY)
        warm = drafter.num_caught_up - cold
        counts = engine.stats().speculative
    assert again == first
    assert cold >= 100 and warm < 16  # the 6 whole blocks of the prompt are found
    assert counts.num_accepted >= 0.9 * counts.num_drafted > 0


@pytest.mark.slow
async def test_a_draft_that_disagrees_costs_nothing_but_time(tiny_llama_dir: Path) -> None:
    """SmolLM2 drafting for the tiny random model: few drafts accepted, the plain tokens."""
    config = tiny_config(tiny_llama_dir, WorkersConfig(), num_blocks=160)
    prompts = _prompts()[:3]
    async with AsyncEngine(config) as plain:
        want = await run_all(plain, prompts, GREEDY)
    async with AsyncEngine(_with_draft(config, default_model_path())) as engine:
        got = await run_all(engine, prompts, GREEDY)
        counts = engine.stats().speculative
        engine.check_integrity()
    assert got == want
    assert counts.num_drafted > 0 and counts.num_accepted < counts.num_drafted / 2


async def test_the_pool_holds_both_models_kv(tiny_llama_dir: Path) -> None:
    """A byte budget buys half the blocks when the draft's KV is as big as the model's."""
    base = tiny_config(tiny_llama_dir, WorkersConfig())
    config = base.replace(
        cache=dataclasses.replace(base.cache, num_blocks=None, kv_memory_bytes=64 << 20)
    )
    async with AsyncEngine(config) as plain:
        blocks = plain.stats().num_blocks_total
    async with AsyncEngine(_with_draft(config, tiny_llama_dir)) as engine:
        assert engine.stats().num_blocks_total == blocks // 2


async def test_a_draft_with_another_vocabulary_is_refused(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other-vocab"
    shutil.copytree(tiny_llama_dir, other)
    tensors = load_file(str(other / "model.safetensors"))
    tensors["embed_tokens.weight"] = tensors["embed_tokens.weight"][:1000].clone()
    save_file(tensors, str(other / "model.safetensors"))
    arch = json.loads((other / "config.json").read_text()) | {"vocab_size": 1000}
    (other / "config.json").write_text(json.dumps(arch))
    config = _with_draft(tiny_config(tiny_llama_dir, WorkersConfig()), other)
    with pytest.raises(ConfigError, match="another vocabulary"):
        async with AsyncEngine(config):
            pass


async def test_draft_model_needs_a_path(tiny_llama_dir: Path) -> None:
    spec = SpeculativeConfig(speculative="draft-model")
    config = tiny_config(tiny_llama_dir, WorkersConfig()).replace(speculative=spec)
    with pytest.raises(ConfigError, match="needs --draft-model PATH"):
        async with AsyncEngine(config):
            pass


REAL_PROMPTS = [
    [ChatMessage("user", "Count from 1 to 25, separated by commas.")],
    [ChatMessage("user", "Write a short paragraph about trains, then list 3 facts about rain.")],
    "The quick brown fox jumps over the lazy dog. " * 4,
]


@pytest.mark.slow
async def test_real_model_drafting_for_itself_gives_the_plain_tokens(
    real_engine: AsyncEngine,
) -> None:
    """SmolLM2 as its own draft (the gate on): greedy alone and together the plain tokens,
    nearly every draft accepted; colocated too."""

    async def tokens(engine: AsyncEngine, prompt: object) -> list[int]:
        ids: list[int] = []
        params = SamplingParams(max_tokens=32, temperature=0.0)
        async for out in engine.generate(prompt, params):  # type: ignore[arg-type]
            ids.extend(out.token_ids)
        return ids

    want = [await tokens(real_engine, p) for p in REAL_PROMPTS]
    config = _with_draft(real_config(), default_model_path(), gate="on")
    async with AsyncEngine(config) as engine:
        alone = [await tokens(engine, p) for p in REAL_PROMPTS]
        together = await asyncio.gather(*(tokens(engine, p) for p in REAL_PROMPTS))
        counts = engine.stats().speculative
        engine.check_integrity()
    assert alone == want
    assert list(together) == want
    assert counts.num_accepted >= 0.8 * counts.num_drafted > 0, counts
    colocated = config.replace(workers=WorkersConfig(colocated=True))
    async with AsyncEngine(colocated) as engine:
        together = await asyncio.gather(*(tokens(engine, p) for p in REAL_PROMPTS))
        assert engine.stats().speculative.num_accepted > 0
        engine.check_integrity()
    assert list(together) == want
