"""Prefill and decode on different replicas behind vLLM's router from PyPI in its PD mode
(`vllm-router --vllm-pd-disaggregation`): the router sends each request to the producer with
`max_tokens: 1` and `do_remote_decode`, copies the `kv_transfer_params` it answers into the
request it sends the consumer, which pulls the prompt's blocks over NIXL and decodes. Answers
equal a colocated replica's for 50 mixed requests (chat and completions, streamed or not,
greedy and seeded sampling); a second turn pulls only the blocks the consumer lacks; a producer
killed after handing out its blocks costs the consumer a recompute, never an answer."""

from __future__ import annotations

import importlib.util
import json
import random
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_proc import ServerProcs, free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm_router") is None or importlib.util.find_spec("nixl") is None,
        reason="vllm-router or nixl is not installed",
    ),
]

BLOCK = 16
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "stone",
    "cloud",
    "paper",
    "lamp",
    "orbit",
    "salt",
    "cedar",
]


def metric(base: str, name: str) -> float:
    match = re.search(rf"^{name}(?:_total)? (\S+)$", httpx.get(f"{base}/metrics").text, re.M)
    assert match, name
    return float(match.group(1))


def replica(model: Path, cache_dir: Path, role: str | None) -> list[str]:
    args = ["--model", str(model), "--cache-dir", str(cache_dir), "--no-disk-cache"]
    return args + (["--kv-transfer", "nixl", "--kv-role", role] if role else [])


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def mixed_requests(n: int) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        sampling: dict[str, Any] = {"temperature": 0.0}
        if i % 3 == 2:
            sampling = {"temperature": 0.8, "seed": i}
        body: dict[str, Any] = {"model": "default", "max_tokens": rng.randint(1, 16), **sampling}
        body["stream"] = i % 4 == 1
        if i % 2:
            body["prompt"] = text(rng, rng.randint(3, 300))
            out.append(("/v1/completions", body))
        else:
            body["messages"] = [
                {"role": "system", "content": text(rng, rng.randint(5, 200))},
                {"role": "user", "content": text(rng, rng.randint(1, 60))},
            ]
            out.append(("/v1/chat/completions", body))
    return out


def answer(client: httpx.Client, base: str, path: str, body: dict[str, Any]) -> str:
    """The answer's text (streamed answers joined)."""
    if not body.get("stream"):
        r = client.post(base + path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return str(choice["message"]["content"] if "message" in choice else choice["text"])
    parts = []
    with client.stream("POST", base + path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                delta = choice.get("delta", {})
                parts.append(delta.get("content") or choice.get("text") or "")
    return "".join(parts)


def test_router_pd_mode_matches_a_colocated_replica(tmp_path: Path, tiny_llama_dir: Path) -> None:
    procs = ServerProcs(tmp_path)
    try:
        launched = [
            procs.launch(replica(tiny_llama_dir, tmp_path / name, role))
            for name, role in (("p", "producer"), ("c", "consumer"), ("r", None))
        ]
        producer, consumer, reference = (procs.wait(*one)[0] for one in launched)
        port = free_port()
        cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
               "--port", str(port), "--vllm-pd-disaggregation", "--prefill", producer,
               "--decode", consumer, "--policy", "round_robin",
               "--prometheus-port", str(free_port())]  # fmt: skip
        router = procs.wait(*procs.launch_cmd(cmd, port))[0]
        requests = mixed_requests(50)
        with httpx.Client(timeout=120) as client, ThreadPoolExecutor(8) as pool:
            routed = list(pool.map(lambda r: answer(client, router, *r), requests))
            local = list(pool.map(lambda r: answer(client, reference, *r), requests))
            assert routed == local
            assert metric(consumer, "deepinfer_kv_transfer_pulled_blocks") > 50
            assert metric(consumer, "deepinfer_kv_transfer_failed_pulls") == 0
            assert metric(producer, "deepinfer_kv_transfer_held_blocks") == 0

            # a second turn: the first turn's blocks are the consumer's own now
            system = text(random.Random(1), 120)
            turn = [{"role": "system", "content": system}, {"role": "user", "content": "one"}]
            body = {"model": "default", "max_tokens": 6, "temperature": 0.0, "messages": turn}
            first = answer(client, router, "/v1/chat/completions", body)
            local_before = metric(consumer, "deepinfer_kv_transfer_local_blocks")
            pulled_before = metric(consumer, "deepinfer_kv_transfer_pulled_blocks")
            turn += [{"role": "assistant", "content": first}, {"role": "user", "content": "two"}]
            assert answer(client, router, "/v1/chat/completions", body) == answer(
                client, reference, "/v1/chat/completions", body
            )
            local = metric(consumer, "deepinfer_kv_transfer_local_blocks") - local_before
            pulled = metric(consumer, "deepinfer_kv_transfer_pulled_blocks") - pulled_before
            assert local >= 100 // BLOCK and 0 < pulled <= 3, (local, pulled)

            # the producer killed after it answered: the consumer computes the prompt
            kept = []
            for i in range(3):
                body = {"model": "default", "prompt": text(random.Random(i + 5), 150),
                        "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
                r = client.post(producer + "/v1/completions", json=body)
                kept.append(r.json()["kv_transfer_params"])
                assert kept[-1]["remote_block_ids"]
            procs.kill9(0)
            failed_before = metric(consumer, "deepinfer_kv_transfer_failed_pulls")
            for i, params in enumerate(kept):
                body = {"model": "default", "prompt": text(random.Random(i + 5), 150),
                        "max_tokens": 8, "temperature": 0.0}  # fmt: skip
                want = answer(client, reference, "/v1/completions", body)
                got = answer(
                    client, consumer, "/v1/completions", body | {"kv_transfer_params": params}
                )
                assert got == want
            assert metric(consumer, "deepinfer_kv_transfer_failed_pulls") - failed_before == 3
    finally:
        procs.reap()
