"""`GET /v1/stats` and `/v1/stats/stream` over the null model with a disk tier: the totals equal
what the official client was told request by request, cached tokens appear on a repeated prompt,
the disk tier's blocks are counted per retention class with their expiry, and the percentiles
are those of numpy over the same weighted samples."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.api.app import create_app
from deepinfer.api.ops.live_stats import LiveStats, percentiles
from deepinfer.config import CacheConfig, Config, DiskCacheConfig, ModelConfig, SchedulerConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.types import Usage
from tests.api.live_server import LiveServer

DAY_S = 86_400.0


@pytest.fixture(scope="module")
def null_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    config = Config(
        model=ModelConfig(path=Path("null")),
        cache=CacheConfig(kv_memory_bytes=64 << 20),
        disk_cache=DiskCacheConfig(enabled=True, cache_dir=tmp_path_factory.mktemp("disk")),
        scheduler=SchedulerConfig(max_num_seqs=16),
    )
    server = LiveServer(create_app(AsyncEngine(config), config.server)).start()
    try:
        yield server
    finally:
        server.stop()


def _stats(server: LiveServer) -> dict:
    response = httpx.get(f"{server.url}/v1/stats", timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    return response.json()


def test_totals_match_what_clients_were_told(null_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{null_server.url}/v1", api_key="none")
    before = _stats(null_server)
    prompt = "A prompt long enough to fill a few cache blocks. " * 8
    usages = []
    for retention in ("agent", "chat", "chat"):
        answer = client.chat.completions.create(
            model="null", messages=[{"role": "user", "content": f"{retention}: {prompt}"}],
            max_tokens=40, temperature=0, extra_body={"cache_retention": retention},
        )  # fmt: skip
        assert answer.usage is not None
        usages.append(answer.usage)
    deadline = time.monotonic() + 10
    while (after := _stats(null_server))["disk"]["writes"] < before["disk"]["writes"] + 2:
        assert time.monotonic() < deadline, "the disk tier wrote nothing"
        time.sleep(0.2)
    after = _stats(null_server)
    tokens = {k: after["tokens"][k] - before["tokens"][k] for k in after["tokens"]}
    assert tokens["prompt"] == sum(u.prompt_tokens for u in usages)
    assert tokens["generated"] == sum(u.completion_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)  # type: ignore[union-attr]
    assert cached > 0  # the third request repeats the second
    assert tokens["cached_device"] + tokens["cached_host"] + tokens["cached_disk"] == cached
    assert tokens["computed"] == tokens["prompt"] - cached
    assert after["running"] == after["waiting"] == 0
    assert after["latency"]["ttft"]["count"] >= 3
    assert after["latency"]["itl"]["count"] >= sum(u.completion_tokens - 1 for u in usages)
    assert {w["name"] for w in after["workers"]} == {"prefill", "decode"}
    assert all(w["steps"] > 0 and w["step_ms"] > 0 for w in after["workers"])
    assert after["prefill"] is not None and after["prefill"]["buckets"]


@pytest.mark.slow
def test_disk_classes_count_blocks_with_their_expiry(null_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{null_server.url}/v1", api_key="none")
    client.chat.completions.create(
        model="null", messages=[{"role": "user", "content": "agent work, kept three days " * 12}],
        max_tokens=4, extra_body={"cache_retention": "agent"},
    )  # fmt: skip
    now = time.time()
    deadline = time.monotonic() + 15  # the summary is read again every few seconds
    while True:
        disk = _stats(null_server)["disk"]
        classes = {c["name"]: c for c in disk["classes"]}
        if classes["agent"]["blocks"] and classes["chat"]["blocks"]:
            break
        assert time.monotonic() < deadline, classes
        time.sleep(0.5)
    assert classes["agent"]["retention_s"] == 3 * DAY_S
    assert classes["chat"]["retention_s"] == 7 * DAY_S
    for name, days in (("agent", 3), ("chat", 7)):
        c = classes[name]
        assert c["tokens"] == 16 * c["blocks"]  # full blocks only
        assert now - 120 < c["next_expiry_s"] - days * DAY_S <= c["last_expiry_s"] - days * DAY_S
        assert c["last_expiry_s"] - days * DAY_S < now + 5
    assert sum(c["blocks"] for c in classes.values()) <= disk["blocks"]
    assert disk["segments"] >= 1 and disk["max_bytes"] == DiskCacheConfig().max_bytes


def test_stream_sends_a_snapshot_every_interval(null_server: LiveServer) -> None:
    snapshots = []
    with httpx.stream("GET", f"{null_server.url}/v1/stats/stream?interval_s=0.25", timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                snapshots.append(json.loads(line[6:]))
                if len(snapshots) == 3:
                    break
    times = [s["time_s"] for s in snapshots]
    assert all(0.2 < b - a < 2.0 for a, b in itertools.pairwise(times))
    bad = httpx.get(f"{null_server.url}/v1/stats/stream?interval_s=0", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "interval_s"


def test_stream_ends_when_the_server_begins_to_close(null_server: LiveServer) -> None:
    closing = null_server.config.app.state.closing
    try:
        with httpx.stream("GET", f"{null_server.url}/v1/stats/stream", timeout=10) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            null_server.call(closing.set)
            start = time.monotonic()
            rest = list(lines)  # ends, without an error frame: the server is going away
            assert time.monotonic() - start < 2 and not any("error" in line for line in rest)
    finally:
        null_server.call(closing.clear)


@given(st.lists(st.tuples(st.floats(0, 10), st.integers(1, 5)), min_size=1, max_size=60))
def test_weighted_percentiles_equal_numpy(samples: list[tuple[float, int]]) -> None:
    got = percentiles(samples)
    expanded = np.repeat([v for v, _ in samples], [n for _, n in samples])
    assert got.count == len(expanded)
    for q, value in ((50, got.p50_ms), (90, got.p90_ms), (99, got.p99_ms)):
        expected = 1e3 * float(np.percentile(expanded, q, method="inverted_cdf"))
        assert value == pytest.approx(expected)


def test_live_stats_forget_samples_past_the_window() -> None:
    now = [0.0]
    live = LiveStats(window_s=10, clock=lambda: now[0])
    live.on_prompt(Usage(prompt_tokens=10, completion_tokens=0, cached_tokens=4))
    live.on_first_tokens(1, ttft_s=0.5)
    live.on_tokens(3, gap_s=0.02)
    live.on_step("decode", 0.004)
    now[0] = 5.0
    live.on_first_tokens(1, ttft_s=0.1)
    assert live.ttft().count == 2 and live.itl().count == 3
    assert live.step_ms("decode") == (pytest.approx(4.0), pytest.approx(4.0))
    now[0] = 12.0
    assert live.ttft().count == 1 and live.ttft().p50_ms == pytest.approx(100.0)
    assert live.itl().count == 0 and live.itl().p50_ms is None
    assert live.step_ms("decode") == (None, pytest.approx(4.0))  # last step still shown
    assert live.step_ms("prefill") == (None, None)
    counts = live.tokens(computed=6)
    assert (counts.prompt, counts.generated, counts.cached_device) == (10, 5, 4)
