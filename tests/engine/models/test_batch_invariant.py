"""`--batch-invariant` on the real model: a request's token ids and logprobs (their float bits,
top alternatives included) are the same run alone on a cold engine, inside random batches of up
to 32 others, with its prompt chunked at random sizes, with its prefix served from the device,
host and disk tiers (the last after a restart), in both worker modes, with one thread and two,
with speculative decoding verifying drafts.
The same runs with the mode off show what the default mode does not promise."""

from __future__ import annotations

import asyncio
import functools
import math
import random
import struct
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from deepinfer.config import (
    CacheConfig,
    Config,
    DiskCacheConfig,
    HostCacheConfig,
    ModelConfig,
    RuntimeConfig,
    SchedulerConfig,
    SpeculativeConfig,
    WorkersConfig,
)
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.types import Usage
from deepinfer.errors import ConfigError, ModelLoadError
from deepinfer.request import SamplingParams
from deepinfer.text.recipe import ChatMessage

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful assistant. Answer briefly, in plain words, and check each fact. " * 14
TARGETS = [
    ([ChatMessage("system", SYSTEM), ChatMessage("user", "Why is the sky blue?")], 0.0),
    ([ChatMessage("system", SYSTEM), ChatMessage("user", "Name three rivers.")], 0.8),
    ([ChatMessage("user", "Write one sentence about the moon.")], 0.0),
]
"""(prompt, temperature): greedy and seeded sampling; two share a system prompt of 7 blocks."""
FILLER = [
    "Count from one to twenty.",
    "Describe a cat.",
    "What is 12 times 13? Explain.",
    "List the planets in order from the sun, with one fact each.",
    "Translate 'good morning' into French and Spanish.",
]

Bits = tuple[tuple[int, bytes, tuple[tuple[int, bytes], ...]], ...]
"""Per generated token: id, logprob's float bits, top (id, logprob bits) pairs."""


def _params(temperature: float) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=temperature, seed=7, logprobs=3)


def _f(x: float | None) -> bytes:
    return struct.pack("<d", float("nan") if x is None else x)


async def _generate(
    engine: AsyncEngine, prompt: Sequence[ChatMessage], params: SamplingParams
) -> tuple[Bits, Usage]:
    bits = []
    async for out in engine.generate(list(prompt), params):
        for t in out.logprobs:
            bits.append((t.token_id, _f(t.logprob), tuple((i, _f(v)) for i, v in t.top_logprobs)))
    return tuple(bits), out.usage


async def _alone(engine: AsyncEngine) -> tuple[list[Bits], list[Usage]]:
    runs = [await _generate(engine, p, _params(temp)) for p, temp in TARGETS]
    return [b for b, _ in runs], [u for _, u in runs]


async def _in_batches(engine: AsyncEngine, rng: random.Random) -> list[Bits]:
    """Each target beside 1-32 others of random prompts and lengths, started together."""
    out = []
    for prompt, temp in TARGETS:
        others = [
            [ChatMessage("user", rng.choice(FILLER) * rng.randint(1, 6))]
            for _ in range(rng.randint(1, 32))
        ]
        tasks = [
            _generate(engine, o, SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0))
            for o in others
        ]
        at = rng.randint(0, len(tasks))
        tasks.insert(at, _generate(engine, prompt, _params(temp)))
        results = await asyncio.gather(*tasks)
        out.append(results[at][0])
    return out


def _config_on(
    tmp: Path, invariant: bool = True, *, device: str = "cpu", **sections: object
) -> Config:
    base = Config(
        model=ModelConfig(batch_invariant=invariant),
        cache=CacheConfig(num_blocks=512),
        disk_cache=DiskCacheConfig(enabled=False, cache_dir=tmp / "disk"),
    )
    runtime = sections.pop("runtime", RuntimeConfig())
    assert isinstance(runtime, RuntimeConfig)
    return replace(base, runtime=replace(runtime, device=device), **sections)  # type: ignore[arg-type]


async def _runs(tmp: Path, invariant: bool, device: str = "cpu") -> dict[str, list[Bits]]:
    """Every way of running the targets, by name; "alone" is the reference."""
    rng = random.Random(1234)
    runs: dict[str, list[Bits]] = {}
    _config = functools.partial(_config_on, device=device)
    cold = _config(tmp, invariant, cache=CacheConfig(num_blocks=512, enable_prefix_caching=False))
    async with AsyncEngine(cold) as engine:
        runs["alone"], _ = await _alone(engine)
        runs["batched"] = await _in_batches(engine, rng)
    every_draft = SpeculativeConfig(speculative="ngram", speculative_gate="off")
    async with AsyncEngine(_config(tmp, invariant, speculative=every_draft)) as engine:
        runs["speculative, every draft verified"], _ = await _alone(engine)
        assert engine.stats().speculative.num_drafted > 0
    chunked = _config(
        tmp,
        invariant,
        workers=WorkersConfig(colocated=True),
        runtime=RuntimeConfig(num_threads=1),
        scheduler=SchedulerConfig(max_num_batched_tokens=rng.randint(20, 60)),
    )
    async with AsyncEngine(chunked) as engine:  # shared system prompt from the device blocks
        runs["colocated, 1 thread, chunked"], usages = await _alone(engine)
        assert usages[1].device_cached_tokens >= 96
        runs["colocated, device cached"], usages = await _alone(engine)
        assert all(u.device_cached_tokens >= u.prompt_tokens - 16 for u in usages)
        runs["colocated, batched"] = await _in_batches(engine, rng)
    disk = DiskCacheConfig(enabled=True, cache_dir=tmp / "disk")
    async with AsyncEngine(_config(tmp, invariant, disk_cache=disk)) as engine:
        runs["disk tier written"], _ = await _alone(engine)
    async with AsyncEngine(_config(tmp, invariant, disk_cache=disk)) as engine:
        runs["restarted, disk cached"], usages = await _alone(engine)
        assert usages[0].disk_cached_tokens >= usages[0].prompt_tokens - 16
    small = _config(
        tmp,
        invariant,
        cache=CacheConfig(num_blocks=40),
        host_cache=HostCacheConfig(enabled="on", max_bytes=64 << 20),
    )
    async with AsyncEngine(small) as engine:
        await _alone(engine)
        for text in FILLER:  # push the targets' blocks out of the 40 device blocks
            await _generate(engine, [ChatMessage("user", text * 30)], _params(0.0))
        runs["host cached"], usages = await _alone(engine)
        assert usages[0].host_cached_tokens >= 64
    return runs


def _assert_all_alike(runs: dict[str, list[Bits]]) -> None:
    reference = runs.pop("alone")
    assert all(len(b) == 8 for b in reference)
    for name, bits in runs.items():
        assert bits == reference, f"{name}: other bits than the request alone"


async def test_batch_invariant_bits_are_the_same_every_way(tmp_path: Path) -> None:
    _assert_all_alike(await _runs(tmp_path, invariant=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_batch_invariant_bits_on_cuda(tmp_path: Path) -> None:
    """The same on CUDA: the triton backend, every matrix through the fixed-order matmul and
    every query through the decode kernel (decode steps replayed from CUDA graphs)."""
    _assert_all_alike(await _runs(tmp_path, invariant=True, device="cuda"))


async def test_default_mode_differs_where_prompts_are_attended_otherwise(tmp_path: Path) -> None:
    """The same comparisons with the mode off find differences (so they can fail): a prompt
    computed whole is attended by torch's fused kernel past 16k query-key pairs, while the
    tail after a cached prefix, or a chunk of a prompt split otherwise under load, is attended
    by the one-row kernel; their sums' order differs in the last bits, which int8 activations
    magnify. This is why a restarted server, serving a prompt's prefix from the disk tier,
    reports other logprobs than the fresh one did for the same prompt."""
    runs = await _runs(tmp_path, invariant=False)
    reference = runs.pop("alone")
    differ = {name: _largest_gap(bits, reference) for name, bits in runs.items()}
    print("default mode, largest logprob gap to the request alone:", differ)
    assert differ["restarted, disk cached"] > 0
    assert differ["colocated, device cached"] > 0


def _largest_gap(runs: list[Bits], reference: list[Bits]) -> float:
    """The largest |logprob difference| over the tokens both give (inf where a token differs)."""
    gap = 0.0
    for bits, ref in zip(runs, reference, strict=True):
        for (tok, lp, _), (ref_tok, ref_lp, _) in zip(bits, ref, strict=False):
            if tok != ref_tok:
                return math.inf
            a, b = struct.unpack("<d", lp)[0], struct.unpack("<d", ref_lp)[0]
            gap = max(gap, abs(a - b))
    return gap


async def test_refused_where_the_arithmetic_depends_on_the_batch(tmp_path: Path) -> None:
    torch_backend = _config_on(tmp_path, runtime=RuntimeConfig(attention_backend="torch"))
    with pytest.raises(ConfigError, match="batch-invariant"):
        async with AsyncEngine(torch_backend):
            pass
    float_matrices = _config_on(
        tmp_path, model=ModelConfig(batch_invariant=True, quantized_matmul="off")
    )
    with pytest.raises(ModelLoadError, match="batch-invariant"):
        async with AsyncEngine(float_matrices):
            pass
