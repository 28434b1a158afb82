"""KV transfer between two engines in this process over NIXL (UCX on the CPU): a producer
prefills and keeps the prompt's blocks, a consumer pulls them and decodes. The consumer's tokens
equal an engine's that computed everything itself, its prefix cache is used first (a second turn
pulls only the new blocks), and every failure (other tokens, an expired hold, a producer gone)
leaves it computing the prompt itself. A producer whose kept blocks are overwritten after the
hold makes the consumer's answer differ: the pulled KV is what the consumer decodes from."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from deepinfer.config import Config, KVRole, KVTransferConfig, WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.kv_transfer.params import KVTransferParams
from deepinfer.request import SamplingParams
from tests.engine.models import test_window_replay as window
from tests.engine.models.test_window_replay import gemma_dir  # noqa: F401  (its fixture)
from tests.engine.tiny_engine import tiny_config

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None, reason="NIXL is not installed"
)

PREFILL = SamplingParams(max_tokens=1, temperature=0.0)
DECODE = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BLOCK = 16


def config(model_dir: Path, role: KVRole | None, hold_s: float = 60.0) -> Config:
    base = tiny_config(model_dir, WorkersConfig(), num_blocks=128)
    if role is None:
        return base
    transfer = KVTransferConfig(
        kv_transfer="nixl", kv_role=role, kv_transfer_hold_s=hold_s, kv_transfer_timeout_s=5.0
    )
    return base.replace(kv_transfer=transfer)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 131 + j * 17) % 4000 + 200 for j in range(n)]


async def tokens(
    engine: AsyncEngine, ids: list[int], params: SamplingParams,
    transfer: KVTransferParams | None = None, request_id: str | None = None,
) -> list[int]:  # fmt: skip
    out: list[int] = []
    async for delta in engine.generate(ids, params, kv_transfer=transfer, request_id=request_id):
        out.extend(delta.token_ids)
    return out


async def prefill(producer: AsyncEngine, ids: list[int], rid: str) -> KVTransferParams:
    await tokens(producer, ids, PREFILL, KVTransferParams(do_remote_decode=True), rid)
    params = producer.kv_transfer_params(rid)
    assert params is not None and params.do_remote_prefill
    return params


@pytest_asyncio.fixture
async def engines(tiny_llama_dir: Path) -> AsyncIterator[tuple[AsyncEngine, ...]]:
    async with (
        AsyncEngine(config(tiny_llama_dir, "producer")) as producer,
        AsyncEngine(config(tiny_llama_dir, "consumer")) as consumer,
        AsyncEngine(config(tiny_llama_dir, None)) as reference,
    ):
        yield producer, consumer, reference


def pulled(engine: AsyncEngine) -> int:
    transfer = engine.core.kv_transfer
    assert transfer is not None
    stats = transfer.pull_stats()
    assert stats is not None
    return stats.num_pulled_blocks


async def test_consumer_decodes_from_pulled_blocks(engines: tuple[AsyncEngine, ...]) -> None:
    producer, consumer, reference = engines
    holds = producer.core.kv_transfer.holds  # type: ignore[union-attr]
    assert holds is not None
    for i, n in enumerate((70, 33, 100)):
        ids = prompt(n, seed=i)
        params = await prefill(producer, ids, f"p{i}")
        assert params.remote_block_ids is not None
        assert len(params.remote_block_ids) == (n - 1) // BLOCK
        before = pulled(consumer)
        got: list[int] = []
        async for delta in consumer.generate(ids, DECODE, kv_transfer=params):
            got.extend(delta.token_ids)
            usage = delta.usage
        assert got == await tokens(reference, ids, DECODE)
        assert pulled(consumer) - before == (n - 1) // BLOCK
        assert usage.remote_cached_tokens == usage.cached_tokens == (n - 1) // BLOCK * BLOCK
    assert holds.num_released == 3 and holds.num_held_blocks == 0
    consumer.check_integrity()
    producer.check_integrity()


async def test_second_turn_pulls_only_new_blocks(engines: tuple[AsyncEngine, ...]) -> None:
    producer, consumer, reference = engines
    first = prompt(50, seed=7)
    await tokens(consumer, first, DECODE, await prefill(producer, first, "t1"))
    stats = consumer.core.kv_transfer.pull_stats()  # type: ignore[union-attr]
    assert stats is not None
    local_before, pulled_before = stats.num_local_blocks, stats.num_pulled_blocks
    second = first + prompt(40, seed=8)
    got = await tokens(consumer, second, DECODE, await prefill(producer, second, "t2"))
    assert got == await tokens(reference, second, DECODE)
    assert stats.num_local_blocks - local_before == 3  # the first turn's (50 - 1) // 16 blocks
    assert stats.num_pulled_blocks - pulled_before == (90 - 1) // BLOCK - 3


async def test_other_tokens_are_not_pulled(engines: tuple[AsyncEngine, ...]) -> None:
    producer, consumer, reference = engines
    params = await prefill(producer, prompt(60, seed=3), "o1")
    other = prompt(60, seed=4)
    before = pulled(consumer)
    assert await tokens(consumer, other, DECODE, params) == await tokens(reference, other, DECODE)
    assert pulled(consumer) == before
    assert producer.core.kv_transfer.holds.num_held_blocks == 0  # type: ignore[union-attr]


async def test_overwritten_blocks_change_the_answer(engines: tuple[AsyncEngine, ...]) -> None:
    """The check above can fail: KV the consumer pulls is what it decodes from."""
    producer, consumer, reference = engines
    ids = prompt(80, seed=5)
    params = await prefill(producer, ids, "w1")
    assert params.remote_block_ids
    for k, v in producer.core.tiers.copies.kv_caches:
        k[params.remote_block_ids] = 3.0
        v[params.remote_block_ids] = -3.0
    assert await tokens(consumer, ids, DECODE, params) != await tokens(reference, ids, DECODE)


async def test_expired_hold_is_computed_locally(tiny_llama_dir: Path) -> None:
    async with (
        AsyncEngine(config(tiny_llama_dir, "producer", hold_s=0.2)) as producer,
        AsyncEngine(config(tiny_llama_dir, "consumer")) as consumer,
        AsyncEngine(config(tiny_llama_dir, None)) as reference,
    ):
        ids = prompt(64, seed=9)
        params = await prefill(producer, ids, "e1")
        await asyncio.sleep(1.5)  # the side channel expires holds about once a second
        holds = producer.core.kv_transfer.holds  # type: ignore[union-attr]
        assert holds is not None and holds.num_expired == 1
        assert await tokens(consumer, ids, DECODE, params) == await tokens(reference, ids, DECODE)
        assert pulled(consumer) == 0


async def test_producer_gone_is_computed_locally(tiny_llama_dir: Path) -> None:
    async with (
        AsyncEngine(config(tiny_llama_dir, "consumer")) as consumer,
        AsyncEngine(config(tiny_llama_dir, None)) as reference,
    ):
        async with AsyncEngine(config(tiny_llama_dir, "producer")) as producer:
            ids = prompt(64, seed=10)
            params = await prefill(producer, ids, "g1")
        assert await tokens(consumer, ids, DECODE, params) == await tokens(reference, ids, DECODE)
        assert pulled(consumer) == 0
        consumer.check_integrity()


async def test_a_cancelled_pull_frees_its_blocks_only_after_the_read(
    engines: tuple[AsyncEngine, ...],
) -> None:
    """A request cancelled while its blocks are being read (its client gone): the blocks the
    read writes go back to the pool once the read has ended, never before."""
    producer, consumer, reference = engines
    transfer = consumer.core.kv_transfer
    assert transfer is not None and transfer._puller is not None
    puller = transfer._puller
    read = puller._read_blocking
    ended = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_read(*args: object) -> bool | None:
        time.sleep(0.6)
        try:
            return read(*args)  # type: ignore[arg-type]
        finally:
            loop.call_soon_threadsafe(ended.set)

    puller._read_blocking = slow_read  # type: ignore[method-assign]
    free = consumer.core.kv.num_free_blocks
    ids = prompt(80, seed=11)
    params = await prefill(producer, ids, "c1")
    task = asyncio.create_task(tokens(consumer, ids, DECODE, params))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert consumer.core.kv.num_free_blocks == free - (80 - 1) // BLOCK  # still reserved
    await ended.wait()
    await asyncio.sleep(0.05)
    assert consumer.core.kv.num_free_blocks == free
    puller._read_blocking = read  # type: ignore[method-assign]
    assert await tokens(consumer, ids, DECODE) == await tokens(reference, ids, DECODE)
    consumer.check_integrity()


@pytest.mark.slow
async def test_a_sliding_window_model_pulls_its_full_layers(
    gemma_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A tiny Gemma 3 (three layers attending windows of 8 keys, one full): the producer keeps,
    and the consumer pulls, the full layer's blocks; the consumer rebuilds the windowed layers
    by a bounded replay. Its greedy tokens are those of an engine without cache, and its
    log-probabilities within 1e-3 (the replay's chunks are not the cold run's)."""

    def serving(role: KVRole | None) -> Config:
        base = window._config(gemma_dir, tmp_path, prefix_caching=role is not None)
        if role is None:
            return base
        transfer = KVTransferConfig(kv_transfer="nixl", kv_role=role, kv_transfer_timeout_s=5.0)
        return base.replace(kv_transfer=transfer)

    async with (
        AsyncEngine(serving("producer")) as producer,
        AsyncEngine(serving("consumer")) as consumer,
        AsyncEngine(serving(None)) as cold,
    ):
        for i, windows in enumerate((5, 8)):
            ids = window._prompt(windows, seed=i, tail=3)
            params = await prefill(producer, ids, f"s{i}")
            assert params.remote_block_ids
            before = pulled(consumer)
            got: list[int] = []
            logprobs: list[float] = []
            async for out in consumer.generate(ids, window.PARAMS, kv_transfer=params):
                got.extend(out.token_ids)
                for sampled in out.logprobs:
                    logprobs.extend(value for _, value in sampled.top_logprobs)
                usage = out.usage
            window._same((got, logprobs, usage.cached_tokens), await window._generate(cold, ids))
            assert pulled(consumer) - before == len(params.remote_block_ids)
            # computed from the replay's start: the pulled blocks before it are skipped
            assert usage.remote_cached_tokens == usage.cached_tokens > 0
        consumer.check_integrity()
        producer.check_integrity()
