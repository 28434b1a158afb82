"""`--speculative mtp` through the engine, on a tiny random DeepSeek-V3 with a multi-token-
prediction layer (`tests/model/mtp_checkpoint.py`): the outputs are plain decoding's, greedy and
seeded; each step's first draft is the pick of the reference MTP layer (transformers' modules)
at the position before the chunk, over the request's tokens so far, so the layer's KV (caught
up from the hidden states the runner keeps, a bounded number of entries a step) is right; a
prompt run again finds the layer's KV of its whole blocks; a model without the layer, and
separate device groups, are refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer.config import Config, SpeculativeConfig, WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.build_replicas import load, load_mtp
from deepinfer.environment import default_model_path
from deepinfer.errors import ConfigError
from deepinfer.model.loading.gguf_loader import open_gguf
from deepinfer.request import SamplingParams
from deepinfer.runner import worker_mtp
from deepinfer.runner.worker_mtp import MTPDrafter
from deepinfer.scheduler.output import ScheduledChunk
from deepinfer.text.tokenizer import Tokenizer
from tests.conftest import VOCAB
from tests.engine.tiny_engine import run_all, tiny_config

pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from tests.model.mtp_checkpoint import write_mtp_checkpoint

    directory = tmp_path_factory.mktemp("deepseek-mtp")
    reference = write_mtp_checkpoint(
        directory, tmp_path_factory.mktemp("deepseek-4"), vocab_size=VOCAB
    )
    Tokenizer.from_gguf(open_gguf(default_model_path())).save_dir(directory)
    return directory, reference


def _with_mtp(config: Config, gate: str = "off") -> Config:
    spec = SpeculativeConfig(speculative="mtp", speculative_gate=gate)  # type: ignore[arg-type]
    return config.replace(speculative=spec)


def _prompts() -> list[list[int]]:
    """Prompts of 10 to 78 tokens (longer than a small catch-up budget)."""
    return [[(i * 41 + j * 13) % 4000 + 150 for j in range(10 + 17 * (i % 5))] for i in range(5)]


def _log_first_drafts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], int]]:
    """Each drafting chunk's request tokens (up to its last) and first draft."""
    log: list[tuple[list[int], int]] = []
    draft = MTPDrafter._draft

    def logged(self: MTPDrafter, wanting: list[ScheduledChunk]) -> dict[str, list[int]]:
        drafts = draft(self, wanting)
        for c in wanting:
            if drafts[c.request_id]:
                log.append((c.request.all_token_ids, drafts[c.request_id][0]))
        return drafts

    monkeypatch.setattr(MTPDrafter, "_draft", logged)
    return log


def _check_against_reference(reference: Any, log: list[tuple[list[int], int]]) -> int:
    """Every logged first draft is the reference's pick where its top two are apart; how many
    were compared."""
    compared = 0
    for tokens, first in log:
        logits = reference.logits(tokens)[-1]  # the entry at the chunk's start - 1
        top = torch.topk(logits, 2)
        if float(top.values[0] - top.values[1]) > 1e-3:
            assert first == int(top.indices[0]), (len(tokens), first)
            compared += 1
    return compared


@pytest.mark.parametrize("catch_up", [256, 7])
async def test_mtp_drafts_are_the_layers_and_outputs_plain(
    deepseek: tuple[Path, Any], catch_up: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, reference = deepseek
    monkeypatch.setattr(worker_mtp, "CATCH_UP_TOKENS", catch_up)
    config = tiny_config(directory, WorkersConfig(), num_blocks=200)
    prompts = _prompts()
    async with AsyncEngine(config) as plain:
        want = await run_all(plain, prompts, GREEDY)
        want_seeded = await run_all(plain, prompts, SEEDED)
    log = _log_first_drafts(monkeypatch)
    async with AsyncEngine(_with_mtp(config)) as engine:
        got = await run_all(engine, prompts, GREEDY)
        counts = engine.stats().speculative
        got_seeded = await run_all(engine, prompts, SEEDED)
        engine.check_integrity()
        assert engine.stats().num_blocks_used == 0
    assert got == want
    assert got_seeded == want_seeded
    assert counts.proposer == "mtp" and counts.num_drafted > 50
    assert _check_against_reference(reference, log) >= 0.9 * len(log) > 40


async def test_auto_chooses_the_layer_too(
    deepseek: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`auto` on a model with the layer: suffix decoding, n-gram and the layer, per request."""
    directory, reference = deepseek
    config = tiny_config(directory, WorkersConfig(), num_blocks=200)
    prompts = _prompts()
    async with AsyncEngine(config) as plain:
        want = await run_all(plain, prompts, GREEDY)
    log = _log_first_drafts(monkeypatch)
    spec = SpeculativeConfig(speculative="auto", speculative_gate="off")
    async with AsyncEngine(config.replace(speculative=spec)) as engine:
        core = engine._core
        assert core is not None and isinstance(core.decode_runner.drafter, MTPDrafter)
        got = await run_all(engine, prompts, GREEDY)
        counts = engine.stats().speculative
    assert got == want
    assert counts.proposer == "auto" and counts.num_drafted > len(log) > 0
    assert _check_against_reference(reference, log) >= 0.9 * len(log)


async def test_a_prompt_run_again_finds_the_layers_kv(
    deepseek: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, reference = deepseek
    config = _with_mtp(tiny_config(directory, WorkersConfig(), num_blocks=200))
    prompt = [(j * 13) % 4000 + 150 for j in range(100)]
    log = _log_first_drafts(monkeypatch)
    async with AsyncEngine(config) as engine:
        core = engine._core
        assert core is not None and isinstance(core.decode_runner.drafter, MTPDrafter)
        drafter = core.decode_runner.drafter
        first = await run_all(engine, [prompt], GREEDY)
        cold = drafter.num_caught_up
        again = await run_all(engine, [prompt], GREEDY)
        warm = drafter.num_caught_up - cold
    assert again == first
    assert drafter.num_uncovered == 0
    assert cold >= 98 and warm < 16  # the prompt's whole blocks are found the second time
    assert _check_against_reference(reference, log) >= 0.9 * len(log) > 10


async def test_the_pool_holds_the_layers_kv(deepseek: tuple[Path, Any]) -> None:
    """A byte budget buys 3/4 of the blocks with a fourth layer's KV in each."""
    directory, _ = deepseek
    base = tiny_config(directory, WorkersConfig())
    config = base.replace(
        cache=dataclasses.replace(base.cache, num_blocks=None, kv_memory_bytes=64 << 20)
    )
    async with AsyncEngine(config) as plain:
        blocks = plain.stats().num_blocks_total
    async with AsyncEngine(_with_mtp(config)) as engine:
        assert abs(engine.stats().num_blocks_total - blocks * 3 / 4) < 1


async def test_a_model_without_the_layer_is_refused(tiny_llama_dir: Path) -> None:
    config = _with_mtp(tiny_config(tiny_llama_dir, WorkersConfig()))
    with pytest.raises(ConfigError, match="no multi-token-prediction layer"):
        async with AsyncEngine(config):
            pass


def test_separate_device_groups_are_refused(deepseek: tuple[Path, Any]) -> None:
    directory, _ = deepseek
    config = _with_mtp(tiny_config(directory, WorkersConfig()))
    loaded = load(config, directory, torch.float32, torch.device("cpu"))
    assert load_mtp(config, loaded, directory, split=False) is not None
    with pytest.raises(ConfigError, match="needs one device group"):
        load_mtp(config, loaded, directory, split=True)
