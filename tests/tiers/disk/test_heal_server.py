"""The real server (on the tiny random Llama: the healing is the disk tier's, whatever the model)
on a damaged disk cache: index records of a cached prefix overwritten with garbage (through LMDB,
from this process, while the server runs) are misses, not 500s. The same prompts through both
APIs answer 200 with the same greedy text, and every damaged record is counted in /metrics."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import lmdb
import pytest

from deepinfer.config import DiskCacheConfig
from deepinfer.tiers.disk.config import DiskTierConfig
from deepinfer.tiers.disk.records import try_decode_record
from tests.server_proc import ServerProcs, chat

pytestmark = pytest.mark.slow

PROMPT = "Summarize the plot of a story about a lighthouse keeper and a storm. " * 6
MAX_TOKENS = 12
MAP_BYTES = DiskTierConfig(max_bytes=DiskCacheConfig().max_bytes).map_bytes()
"""The server's LMDB map size: a second process must open with the same one (a different size
written into the file makes the other process's next transaction fail with MDB_MAP_RESIZED)."""


def anthropic_text(client: httpx.Client, base: str, prompt: str) -> str:
    body: dict[str, Any] = {
        "model": "default",
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": prompt}],
    }
    r = client.post(f"{base}/v1/messages", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["content"][0]["text"])


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match is not None, f"{name} missing from /metrics"
    return float(match.group(1))


def wait_for(cond: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def damage_every_record(cache_dir: Path) -> int:
    """Overwrite every `blocks` value with bytes no decoder accepts; returns how many. LMDB
    allows this second process on the environment the server has open."""
    (index_dir,) = cache_dir.glob("*/index")
    env = lmdb.open(str(index_dir), max_dbs=8, map_size=MAP_BYTES)
    try:
        db = env.open_db(b"blocks")
        with env.begin(write=True, db=db) as txn:
            keys = [bytes(k) for k in txn.cursor().iternext(keys=True, values=False)]
            for key in keys:
                txn.put(key, b"\xc1 damaged")
        return len(keys)
    finally:
        env.close()


def num_damaged(cache_dir: Path) -> int:
    (index_dir,) = cache_dir.glob("*/index")
    env = lmdb.open(str(index_dir), max_dbs=8, map_size=MAP_BYTES, readonly=True, lock=False)
    try:
        db = env.open_db(b"blocks", create=False)
        with env.begin(db=db) as txn:
            return sum(try_decode_record(k, v) is None for k, v in txn.cursor().iternext())
    finally:
        env.close()


def filler(seed: int) -> str:
    """A distinct prompt of ~250 tokens (16 blocks: five of them cycle the 48-block pool)."""
    return f"Note {seed}: " + " ".join(f"item{seed}x{i}" for i in range(50))


def settled_writes(base: str) -> float:
    """The disk write counter once it stops moving (write-behind done)."""
    name = "deepinfer_disk_cache_writes_total"
    last = -1.0
    while (now := metric(base, name)) != last:
        last = now
        time.sleep(0.5)
    return now


def test_damaged_index_records_are_misses_in_both_apis(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    """Each API in turn: its prompt's blocks pushed out of the small device pool (fillers), every
    disk record damaged, then the prompt again: 200, the same text, nothing from disk, and the
    damaged records counted (the prompt's lookup finds them; the writer then drops the rest)."""
    cache_dir = tmp_path / "cache"
    procs = ServerProcs(tmp_path)
    corrupt = "deepinfer_disk_cache_corrupt_records_total"
    try:
        base, _ = procs.start(["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir),
                               "--num-blocks", "48", "--no-host-cache"])  # fmt: skip
        with httpx.Client(timeout=120) as client:
            reference = chat(client, base, PROMPT, MAX_TOKENS).text
            assert anthropic_text(client, base, PROMPT) == reference
            num_counted = 0
            for round_, api in enumerate(["openai", "anthropic"]):
                for i in range(5):
                    chat(client, base, filler(10 * round_ + i), 1)
                assert settled_writes(base) > 0
                num_counted += damage_every_record(cache_dir)
                assert metric(base, corrupt) < num_counted, "damage counted before any lookup"
                if api == "openai":
                    reply = chat(client, base, PROMPT, MAX_TOKENS)
                    assert reply.text == reference and reply.disk_cached_tokens == 0
                else:
                    assert anthropic_text(client, base, PROMPT) == reference
                wait_for(lambda n=num_counted: metric(base, corrupt) == n)
        assert metric(base, "deepinfer_disk_cache_degraded") == 0
    finally:
        procs.reap()
    assert num_damaged(cache_dir) == 0, "damaged records left in the index"
