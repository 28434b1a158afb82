"""`kill -9` of the real server (server.py, on the tiny random Llama: the crash safety is the disk
tier's, whatever the model) during heavy disk-cache writes, several times on one cache dir: the
index stays consistent, no record fails verification, greedy outputs equal a server with no
caching at all, and blocks written before the crashes are still served from disk afterwards."""

from __future__ import annotations

import fcntl
import os
import random
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from deepinfer.tiers.disk import DiskTier
from deepinfer.tiers.disk.config import DiskTierConfig
from tests.server_proc import Reply, ServerProcs, chat

pytestmark = pytest.mark.slow

NUM_KILLS = 3
NUM_LOAD_THREADS = 3
MAX_TOKENS = 8
WORDS = [
    "river", "stone", "lantern", "copper", "meadow", "signal", "harbor", "thistle", "engine",
    "orchard", "velvet", "canyon", "marble", "falcon", "ledger", "quartz", "willow", "beacon",
]  # fmt: skip


def long_prompt(seed: int, num_words: int = 150) -> str:
    """A distinct prompt of ~200 tokens (about a dozen KV blocks of 16 tokens)."""
    rng = random.Random(seed)
    body = " ".join(rng.choice(WORDS) for _ in range(num_words))
    return f"Document {seed}: {body}. Summarize document {seed} in one sentence."


PROBE = long_prompt(-1, num_words=220)
FIXED = [long_prompt(-2 - i) for i in range(3)]


class Load:
    """Threads sending distinct long prompts back to back until stopped; errors (the server being
    killed under them) are expected and ignored."""

    def __init__(self, base: str, phase: int) -> None:
        self.base, self.phase = base, phase
        self.stop_event = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True)
            for i in range(NUM_LOAD_THREADS)
        ]
        for t in self.threads:
            t.start()

    def _run(self, worker: int) -> None:
        with httpx.Client(timeout=60) as client:
            for j in range(10_000):
                if self.stop_event.is_set():
                    return
                seed = 1_000_000 * self.phase + 1000 * worker + j
                try:
                    chat(client, self.base, long_prompt(seed), max_tokens=4)
                except httpx.HTTPError:
                    time.sleep(0.05)

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(60)


def replies(base: str, prompts: list[str]) -> list[Reply]:
    with httpx.Client(timeout=120) as client:
        return [chat(client, base, p, MAX_TOKENS) for p in prompts]


def open_tier(cache_dir: Path) -> DiskTier:
    (fingerprint_file,) = cache_dir.glob("*/fingerprint")
    tier = DiskTier(fingerprint_file.read_text(), DiskTierConfig(cache_dir=cache_dir))
    tier.open()
    return tier


def check_raw_index(cache_dir: Path) -> int:
    """Check the index exactly as the crash left it (the tier opens read-only: we hold the writer
    lock, so no recovery runs first). Returns its block count."""
    (lock_path,) = cache_dir.glob("*/writer.lock")
    fd = os.open(lock_path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        tier = open_tier(cache_dir)
        try:
            assert tier.stats().readonly
            tier.check_integrity()
            assert tier.verify_all() == 0, "an indexed record does not verify after kill -9"
            return tier.stats().num_blocks
        finally:
            tier.close()
    finally:
        os.close(fd)


def num_indexed_blocks(cache_dir: Path) -> int:
    """Blocks in the index, read alongside a running server (the tier opens read-only)."""
    tier = open_tier(cache_dir)
    try:
        return tier.stats().num_blocks
    finally:
        tier.close()


def settled_index(cache_dir: Path, quiet_s: float = 1.5, timeout_s: float = 30.0) -> int:
    """Blocks in the index once it has not grown for `quiet_s` (the write-behind thread works
    through its queue at its own pace: a fixed wait is too short on a busy machine)."""
    deadline = time.monotonic() + timeout_s
    count = num_indexed_blocks(cache_dir)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = num_indexed_blocks(cache_dir)
        if now == count > 0:
            return count
        count = now
    return count


def disk_cached_tokens_metric(base: str) -> float:
    """The server's counter of prompt tokens served from the disk tier."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    match = re.search(r'^deepinfer_cached_prompt_tokens_total\{tier="disk"\} (\S+)$', text, re.M)
    assert match is not None, "no disk cached-tokens counter in /metrics"
    return float(match.group(1))


def test_kill_9_server_keeps_disk_cache_sound(tmp_path: Path, tiny_llama_dir: Path) -> None:
    rng = random.Random(20240601)
    cache_dir = tmp_path / "cache"
    procs = ServerProcs(tmp_path)
    model = ["--model", str(tiny_llama_dir), "--num-blocks", "64"]
    cached_args = [*model, "--cache-dir", str(cache_dir)]
    try:
        ref = procs.launch([*model, "--no-disk-cache", "--no-prefix-caching"])
        pending = procs.launch(cached_args)
        base, ref_index = procs.wait(*ref)
        reference = replies(base, [PROBE, *FIXED])
        procs.kill9(ref_index)
        assert all(r.cached_tokens == 0 for r in reference)

        base, current = procs.wait(*pending)
        first = replies(base, [PROBE, *FIXED])
        assert [r.text for r in first] == [r.text for r in reference]
        num_before_load = settled_index(cache_dir)  # the write-behind thread has written them
        assert num_before_load > 0
        for kill in range(NUM_KILLS):
            load = Load(base, kill)
            time.sleep(rng.uniform(1.0, 4.0))
            procs.kill9(current)
            load.stop()
            if kill == NUM_KILLS - 1:
                assert check_raw_index(cache_dir) > num_before_load, "the load wrote nothing"
            base, current = procs.start(cached_args)

        probe = replies(base, [PROBE])[0]
        assert probe.text == reference[0].text
        # a fresh process starts with an empty device tier: every hit of its first request is disk
        assert probe.cached_tokens > 0, "blocks written before the crashes were lost"
        assert disk_cached_tokens_metric(base) == probe.cached_tokens
        after = replies(base, FIXED)
        assert [r.text for r in after] == [r.text for r in reference[1:]]
        procs.kill9(current)

        tier = open_tier(cache_dir)
        try:
            assert not tier.stats().readonly and not tier.stats().degraded
            tier.check_integrity()
            assert tier.verify_all() == 0
            assert tier.stats().num_blocks > 0
        finally:
            tier.close()
    finally:
        procs.reap()
