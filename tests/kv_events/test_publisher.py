"""KV events end to end through real ZMQ sockets: a scripted life of blocks across the device
pool, the host tier and the disk tier decodes to exactly the expected stream, sequence numbers
have no gaps, and the replay socket returns missed batches.

Every payload is decoded twice besides our own types: by a plain msgpack decode checked against
the field order vLLM publishes (written out here, independent of `deepinfer.kv_events.wire`),
and by vLLM's own classes where the vllm package is importable (`vllm_decoder`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from deepinfer.cache.block_hash import block_hashes_for, seed_bytes
from deepinfer.cache.manager import KVCacheManager
from deepinfer.kv_events.publisher import END_SEQ, KVEventPublisher
from deepinfer.kv_events.recorder import KVEventRecorder
from deepinfer.kv_events.wire import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, external_hash
from deepinfer.request import Request, SamplingParams
from deepinfer.tiers.disk.config import DiskTierConfig
from deepinfer.tiers.disk.tier import DiskTier
from deepinfer.tiers.host.tier import HostTier
from tests.kv_events.vllm_decoder import vllm_batch_decoder

BLOCK = 4
PAYLOAD = 64
TOPIC = "kv"

STORED_FIELDS = [
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name",
]  # fmt: skip
"""vLLM's `BlockStored` on the wire: a map tagged "type", its fields without defaults in order."""
REMOVED_FIELDS = ["type", "block_hashes", "medium"]


def plain_decode(payload: bytes) -> list[tuple[Any, ...]]:
    """A batch as (type, hashes, parent, tokens, block size, medium) tuples, read with a plain
    msgpack decoder: `[ts, events, data_parallel_rank]`, each event a tagged map."""
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and rank == 0
    out: list[tuple[Any, ...]] = []
    for e in events:
        if e["type"] == "BlockStored":
            assert list(e) == STORED_FIELDS
            out.append(
                ("stored", e["block_hashes"], e["parent_block_hash"], e["token_ids"],
                 e["block_size"], e["medium"])
            )  # fmt: skip
        elif e["type"] == "BlockRemoved":
            assert list(e) == REMOVED_FIELDS
            out.append(("removed", e["block_hashes"], e["medium"]))
        else:
            assert e == {"type": "AllBlocksCleared"}
            out.append(("cleared",))
    return out


def vllm_view(payload: bytes) -> list[tuple[Any, ...]] | None:
    """The same tuples from vLLM's own `KVEventBatch` decoding (None: vllm not importable)."""
    decoder = vllm_batch_decoder()
    if decoder is None:
        return None
    batch = decoder(payload)
    out: list[tuple[Any, ...]] = []
    for e in batch.events:
        name = type(e).__name__
        if name == "BlockStored":
            out.append(
                ("stored", e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.medium)
            )
        elif name == "BlockRemoved":
            out.append(("removed", e.block_hashes, e.medium))
        else:
            out.append(("cleared",))
    return out


class Subscriber:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)
        self.sock.connect(endpoint)

    def next(self) -> tuple[int, bytes]:
        topic, seq, payload = self.sock.recv_multipart()
        assert topic == TOPIC.encode()
        return int.from_bytes(seq, "big"), payload


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.term()


def _request(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, SamplingParams(max_tokens=1))


def _compute(kv: KVCacheManager, request: Request) -> None:
    assert kv.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)


@pytest.mark.parametrize("hash_format", ["int64", "bytes"])
def test_scripted_life_of_blocks(
    ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path, hash_format: str
) -> None:
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    recorder = KVEventRecorder(BLOCK, hash_format, 10_000)  # type: ignore[arg-type]
    publisher = KVEventPublisher(recorder, pub_ep, replay_ep, TOPIC, context=ctx)
    # A PUB drops what it sends before a SUB's subscription arrives (batch 0 may be lost
    # here, as for any subscriber that joins late: replay gives it back)
    sub = Subscriber(ctx, pub_ep)
    time.sleep(0.3)
    kv = KVCacheManager(4, BLOCK, "fp", track_new_blocks=True, events=recorder.medium(MEDIUM_GPU))
    host = HostTier(PAYLOAD, PAYLOAD)  # one slot
    host.events = recorder.medium(MEDIUM_CPU)
    now = [1000.0]
    disk = DiskTier("fp", DiskTierConfig(cache_dir=tmp_path / "disk"), clock=lambda: now[0])
    disk.events = recorder.medium(MEDIUM_STORAGE)
    disk.open()
    try:
        ids = list(range(10, 19))  # two full blocks and one token
        h0, h1 = block_hashes_for(ids, BLOCK, seed_bytes("fp"))
        x = [external_hash(h, hash_format) for h in (h0, h1)]  # type: ignore[arg-type]
        expected: list[list[tuple[Any, ...]]] = [[("cleared",)]]

        # 1. registered on the device
        request = _request("a", ids)
        _compute(kv, request)
        publisher.end_step()
        expected.append([("stored", x, None, ids[:8], BLOCK, MEDIUM_GPU)])
        # 2. written behind: both to the host tier (one slot: the second evicts the first),
        # the first to disk
        origins = kv.drain_new_origins()
        assert [b for _, b, _ in kv.drain_new_blocks()] == [h0, h1]
        host.offer(h0, bytes(PAYLOAD), None, origins[h0])
        host.offer(h1, bytes(PAYLOAD), None, origins[h1])
        disk.offer(h0, bytes(PAYLOAD), BLOCK, "chat", origins[h0])
        assert disk.flush()
        publisher.end_step()
        expected.append(
            [
                ("stored", x[:1], None, ids[:4], BLOCK, MEDIUM_CPU),
                ("removed", x[:1], MEDIUM_CPU),
                ("stored", x[1:], x[0], ids[4:8], BLOCK, MEDIUM_CPU),
                ("stored", x[:1], None, ids[:4], BLOCK, MEDIUM_STORAGE),
            ]
        )
        # 3. evicted from the device (the pool's blocks reused), still on disk
        kv.free(request)
        other = list(range(500, 511))
        _compute(kv, _request("b", other))
        publisher.end_step()
        y = [external_hash(h, hash_format) for h in block_hashes_for(other, BLOCK, b"fp")]  # type: ignore[arg-type]
        expected.append(
            [
                ("removed", [x[1], x[0]], MEDIUM_GPU),
                ("stored", y, None, other[:8], BLOCK, MEDIUM_GPU),
            ]
        )
        # 4. expired on disk
        now[0] += 8 * 86400
        disk.sweep()
        publisher.end_step()
        expected.append([("removed", x[:1], MEDIUM_STORAGE)])

        received = [sub.next()]
        while received[-1][0] < len(expected) - 1:
            received.append(sub.next())
        # the subscriber may have joined after batch 0 went out: what it has ends the stream
        # and its sequence numbers are consecutive; replay gives the whole stream
        seqs = [seq for seq, _ in received]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        replayed = _replay(ctx, replay_ep, 0)
        assert [seq for seq, _ in replayed] == list(range(len(expected)))
        assert [plain_decode(p) for _, p in replayed] == expected
        assert [p for _, p in replayed][seqs[0] :] == [p for _, p in received]
        views = [vllm_view(p) for _, p in replayed]
        if views[0] is not None:
            assert views == expected
        assert [seq for seq, _ in _replay(ctx, replay_ep, 3)] == [3, 4]
        assert recorder.num_dropped == 0
        kv.check_integrity()
        host.check_integrity()
    finally:
        disk.close()
        publisher.close()
        sub.sock.close(linger=0)


def _replay(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int
) -> list[tuple[int, bytes]]:
    """Ask the replay socket for batches from `start`, as vLLM's consumers do (a REQ-style
    DEALER: empty delimiter, then the start sequence), until the end marker."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            empty, topic, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert (topic, payload) == (b"", b"")
                return out
            assert topic == TOPIC.encode()
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)


def test_full_queue_drops_and_counts() -> None:
    recorder = KVEventRecorder(BLOCK, "int64", 3)
    recorder.removed(MEDIUM_GPU, [bytes(32)] * 2)
    recorder.stored(MEDIUM_GPU, [bytes(32)] * 2, None, [1] * 8)  # no room: dropped
    recorder.removed(MEDIUM_CPU, [bytes(32)])
    assert recorder.num_dropped == 1
    events = recorder.take()
    assert [type(e).__name__ for e in events] == ["BlockRemoved", "BlockRemoved"]
    assert recorder.take() == []


def test_off_by_default_builds_nothing() -> None:
    """Without an endpoint there is no publisher (no thread, no socket); the tiers hold None."""
    import threading

    from deepinfer.config import Config
    from deepinfer.engine.build import build_kv_events

    before = {t.name for t in threading.enumerate()}
    assert build_kv_events(Config().kv_events, 16) is None
    assert "kv-events" not in before | {t.name for t in threading.enumerate()}
    kv = KVCacheManager(4, BLOCK, "fp")
    assert kv.events is None and kv.pool.events is None
    assert HostTier(PAYLOAD, PAYLOAD).events is None


def test_reset_publishes_the_dropped_blocks_only() -> None:
    recorder = KVEventRecorder(BLOCK, "bytes", 100)
    kv = KVCacheManager(8, BLOCK, "fp", events=recorder.medium(MEDIUM_GPU))
    a, b = _request("a", list(range(9))), _request("b", list(range(100, 109)))
    _compute(kv, a)
    _compute(kv, b)
    kv.free(a)
    recorder.take()
    assert kv.reset_prefix_cache() == 2
    (event,) = recorder.take()
    ha = block_hashes_for(list(range(9)), BLOCK, seed_bytes("fp"))
    assert type(event).__name__ == "BlockRemoved"
    assert event.medium == MEDIUM_GPU and sorted(event.block_hashes) == sorted(ha)  # type: ignore[union-attr]
    kv.check_integrity()
