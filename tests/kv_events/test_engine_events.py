"""KV events from a real engine (the tiny random Llama, CPU, with the disk tier) through a real
ZMQ SUB socket: every prompt's full blocks are announced on the device with their tokens and
chained parents, then on disk once written; a second run of the same prompt hits them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from deepinfer.config import DiskCacheConfig, KVEventsConfig, WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.request import SamplingParams
from tests.engine.tiny_engine import tiny_config

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _events(sock: zmq.Socket[bytes]) -> list[dict[str, Any]]:
    """Every event received so far (decoded with a plain msgpack decoder)."""
    out: list[dict[str, Any]] = []
    while sock.poll(200):
        _, _, payload = sock.recv_multipart()
        _, events, _ = msgspec.msgpack.decode(payload)
        out.extend(events)
    return out


@pytest.mark.slow
async def test_engine_publishes_device_and_disk_blocks(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/kv-events"
    config = tiny_config(tiny_llama_dir, WorkersConfig(colocated=True)).replace(
        disk_cache=DiskCacheConfig(cache_dir=tmp_path / "disk"),
        kv_events=KVEventsConfig(kv_events_endpoint=endpoint, kv_events_block_hash="bytes"),
    )
    block_size = config.cache.block_size
    prompt = [(j * 7) % 3000 + 200 for j in range(3 * block_size + 5)]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        async with AsyncEngine(config) as engine:
            sub.connect(endpoint)
            await asyncio.sleep(0.3)  # the subscription reaches the PUB
            async for _ in engine.generate(prompt, GREEDY):
                pass
            await asyncio.sleep(0.5)  # the disk tier's writer, then the next batch
            outs = [out async for out in engine.generate(prompt, GREEDY)]
            assert outs[-1].usage.cached_tokens == 3 * block_size
            await asyncio.sleep(0.2)
            events = await asyncio.to_thread(_events, sub)
    finally:
        sub.close(linger=0)
        ctx.term()
    stored = [e for e in events if e["type"] == "BlockStored"]
    device = [e for e in stored if e["medium"] == "GPU"]  # vLLM's name for the engine's own pool
    disk = [e for e in stored if e["medium"] == "STORAGE"]
    hashes = [h for e in device for h in e["block_hashes"]]
    tokens = [t for e in device for t in e["token_ids"]]
    assert len(hashes) >= 3 and tokens[: 3 * block_size] == prompt[: 3 * block_size]
    assert device[0]["parent_block_hash"] is None
    assert all(len(h) == 32 for h in hashes)
    assert all(e["block_size"] == block_size for e in stored)
    # each prompt block written to disk carries its parent and tokens
    on_disk = {e["block_hashes"][0]: e for e in disk}
    for i, h in enumerate(hashes[:3]):
        assert on_disk[h]["token_ids"] == prompt[i * block_size : (i + 1) * block_size]
        assert on_disk[h]["parent_block_hash"] == (hashes[i - 1] if i else None)
