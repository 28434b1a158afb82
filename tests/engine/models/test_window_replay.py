"""A sliding-window model behind the prefix cache (`--window-kv window`): its windowed layers keep
only their window, and a prefix hit rebuilds their state from a stored window or by a bounded
replay. On a tiny random Gemma 3 (windows of 8 keys, three windowed layers and one full: a
replay is 3 x 7 = 21 positions), for prefixes of 1 to 8 windows cached in each tier and resumed
where a request ended and at an arbitrary block: greedy tokens identical and log-probabilities
within 1e-3 of the run without cache; the pools' invariants hold after every step, and no
request holds a windowed block its next query cannot read."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from deepinfer.config import (
    CacheConfig,
    Config,
    DiskCacheConfig,
    HostCacheConfig,
    ModelConfig,
    SchedulerConfig,
    WorkersConfig,
)
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.core import EngineCore
from deepinfer.environment import default_model_path
from deepinfer.model.loading.gguf_loader import open_gguf
from deepinfer.request import SamplingParams
from deepinfer.text.tokenizer import Tokenizer

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, WINDOW = 64, 4, 2, 16, 49152, 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
BLOCK = 4
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 4-layer Gemma 3 in safetensors, with the real SmolLM2 tokenizer."""
    path = tmp_path_factory.mktemp("tiny-gemma3")
    g = torch.Generator().manual_seed(0)

    def w(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    tensors = {"embed_tokens.weight": w(VOCAB, HIDDEN, scale=0.5), "norm.weight": w(HIDDEN)}
    for i in range(len(LAYER_TYPES)):
        p = f"layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": w(HIDDEN),
            p + "post_attention_layernorm.weight": w(HIDDEN),
            p + "pre_feedforward_layernorm.weight": w(HIDDEN),
            p + "post_feedforward_layernorm.weight": w(HIDDEN),
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": w(HEAD_DIM),
            p + "self_attn.k_norm.weight": w(HEAD_DIM),
            p + "mlp.gate_proj.weight": w(2 * HIDDEN, HIDDEN),
            p + "mlp.up_proj.weight": w(2 * HIDDEN, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, 2 * HIDDEN),
        }
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "model_type": "gemma3_text", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN, "num_hidden_layers": len(LAYER_TYPES),
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "rope_theta": 1e6,
        "rope_local_base_freq": 100.0, "sliding_window": WINDOW, "layer_types": LAYER_TYPES,
        "query_pre_attn_scalar": 24, "tie_word_embeddings": True,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    Tokenizer.from_gguf(open_gguf(default_model_path())).save_dir(path)
    return path


@pytest.fixture(autouse=True)
def integrity_every_step(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Check the scheduler's and both pools' invariants after every step's update."""
    update = EngineCore.update

    def checked(self: EngineCore, lane: Any, so: Any, out: Any) -> Any:
        deltas = update(self, lane, so, out)
        self.check_integrity()
        return deltas

    monkeypatch.setattr(EngineCore, "update", checked)
    yield


def _config(
    model: Path,
    cache_dir: Path,
    *,
    prefix_caching: bool = True,
    disk: bool = False,
    host: bool = False,
    window_kv: str = "window",
    colocated: bool = False,
) -> Config:
    return Config(
        model=ModelConfig(path=model, dtype="float32"),
        cache=CacheConfig(
            block_size=BLOCK,
            num_blocks=400,
            enable_prefix_caching=prefix_caching,
            window_kv=window_kv,  # type: ignore[arg-type]
        ),
        host_cache=HostCacheConfig(enabled="on" if host else "off", max_bytes=64 << 20),
        disk_cache=DiskCacheConfig(enabled=disk, cache_dir=cache_dir),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24),
        workers=WorkersConfig(colocated=colocated, prefill_max_batched_tokens=24),
    )


def _prompt(num_windows: int, seed: int, tail: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 5000, (num_windows * WINDOW + tail,), generator=g).tolist()


async def _generate(engine: AsyncEngine, ids: list[int]) -> tuple[list[int], list[float], int]:
    """Greedy tokens, the top-5 log-probabilities at each, and the prompt tokens served from
    cache."""
    tokens: list[int] = []
    logprobs: list[float] = []
    cached = 0
    async for out in engine.generate(ids, PARAMS):
        tokens.extend(out.token_ids)
        for sampled in out.logprobs:
            logprobs.extend(value for _, value in sampled.top_logprobs)
        cached = out.usage.cached_tokens
    return tokens, logprobs, cached


Answer = tuple[list[int], list[float], int]
"""Greedy tokens, the top-5 log-probabilities at each, the prompt tokens served from cache."""


def _same(got: Answer, want: Answer) -> None:
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1]) == 5 * len(want[0])
    assert torch.allclose(torch.tensor(got[1]), torch.tensor(want[1]), atol=1e-3, rtol=0)


WINDOWS = range(1, 9)


def _sessions() -> list[tuple[list[int], list[int], list[int]]]:
    """Per prefix length (1 to 8 windows): a first turn, the turn resuming it (its prompt, a
    few more tokens), and a prompt that shares its first blocks then goes elsewhere (resumes
    at an arbitrary block, not where a request ended)."""
    out = []
    for k in WINDOWS:
        first = _prompt(k, k, 3)
        resumed = first + _prompt(0, 100 + k, 5)
        branch = first[: (len(first) * 2 // 3) // BLOCK * BLOCK + 1] + _prompt(0, 200 + k, 7)
        out.append((first, resumed, branch))
    return out


async def _cold(model: Path, tmp: Path) -> list[list[Answer]]:
    async with AsyncEngine(_config(model, tmp, prefix_caching=False)) as engine:
        return [[await _generate(engine, p) for p in s] for s in _sessions()]


@pytest.fixture(scope="module")
def cold(gemma_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[Answer]]:
    return asyncio.run(_cold(gemma_dir, tmp_path_factory.mktemp("cold")))


@pytest.mark.slow
@pytest.mark.parametrize("colocated", [False, True])
async def test_device_tier_resumes_exactly(
    gemma_dir: Path, tmp_path: Path, cold: Any, colocated: bool
) -> None:
    """Turns resumed from the device pools (the windowed pool still holds the windows) and
    prompts branching at an arbitrary block: the answers of the run without cache."""
    config = _config(gemma_dir, tmp_path, colocated=colocated)
    async with AsyncEngine(config) as engine:
        for session, want in zip(_sessions(), cold, strict=True):
            got = [await _generate(engine, p) for p in session]
            for g, w in zip(got, want, strict=True):
                _same(g, w)
            assert got[1][2] >= len(session[0]) - BLOCK  # resumed where the first turn ended
        stats = engine.stats()  # what /metrics reports
        assert 0 < stats.window_blocks_total < stats.num_blocks_total
        assert stats.window_blocks_used == 0  # nothing runs: every window is back in the LRU


@pytest.mark.slow
async def test_resume_from_the_disk_tier(gemma_dir: Path, tmp_path: Path, cold: Any) -> None:
    """After a restart the disk tier has the full layers' blocks, and the windowed layers' KV of
    the window before each prompt's end: a resumed turn computes from that boundary, exactly; a
    prompt branching at an arbitrary block replays from at most 21 positions (rounded to
    blocks) before its hit's end."""
    async with AsyncEngine(_config(gemma_dir, tmp_path, disk=True)) as engine:
        for session in _sessions():
            await _generate(engine, session[0])
    async with AsyncEngine(_config(gemma_dir, tmp_path, disk=True)) as engine:
        for session, want in zip(_sessions(), cold, strict=True):
            got = [await _generate(engine, p) for p in (session[1], session[2])]
            for g, w in zip(got, want[1:], strict=True):
                _same(g, w)
            boundary = len(session[0]) // BLOCK * BLOCK
            assert got[0][2] == boundary  # the first turn's prompt end, window from disk
            hit = (len(session[2]) - 8) // BLOCK * BLOCK  # the shared blocks
            replay_start = max(0, hit - 3 * (WINDOW - 1)) // BLOCK * BLOCK
            if hit + WINDOW <= boundary:  # no window stored near the hit: a replay
                assert got[1][2] == replay_start
            else:  # the window read from disk for the resumed turn may serve it
                assert replay_start <= got[1][2] <= hit


@pytest.mark.slow
async def test_replay_from_the_host_tier(gemma_dir: Path, tmp_path: Path, cold: Any) -> None:
    """Full-layer blocks pushed out of the device pool and back from host memory."""
    async with AsyncEngine(_config(gemma_dir, tmp_path, host=True)) as engine:
        for session in _sessions():
            await _generate(engine, session[0])
        engine.core.kv.reset_prefix_cache()  # the device pools forget: hits come from host RAM
        for session, want in zip(_sessions(), cold, strict=True):
            ids, logprobs, cached = await _generate(engine, session[1])
            _same((ids, logprobs, cached), want[1])
            hit = len(session[0]) // BLOCK * BLOCK
            assert cached == max(0, hit - 3 * (WINDOW - 1)) // BLOCK * BLOCK


async def test_every_layer_mode_matches(gemma_dir: Path, tmp_path: Path, cold: Any) -> None:
    """`--window-kv all` (the baseline: every layer keeps every token) gives the same answers."""
    async with AsyncEngine(_config(gemma_dir, tmp_path, window_kv="all")) as engine:
        for session, want in zip(_sessions()[:3], cold[:3], strict=True):
            for p, w in zip(session, want, strict=True):
                _same(await _generate(engine, p), w)
        assert engine.core.kv.usage().num_window_blocks == 0
