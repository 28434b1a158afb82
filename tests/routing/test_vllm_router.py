"""Two replicas of the real server behind vLLM's router from PyPI (`vllm-router`), routing on
our KV events (`kv_aware`): each session's later turns land where its prefix is cached, the
router counts those prefixes from the events (its own decision log), and a replica killed with
`kill -9` moves its sessions to the other without a failed request."""

from __future__ import annotations

import importlib.util
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_proc import ServerProcs, free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm_router") is None, reason="vllm-router is not installed"
    ),
]

BLOCK = 16  # the server's default --block-size
THINK_S = 0.5
"""An agent's pause between turns (its tool calls): the events of a turn reach the router
within ~100 ms (published per step, polled by the router), the tiny model answers faster."""
METRIC = re.compile(
    r'^deepinfer_requests_total\{endpoint="/v1/chat/completions",status="200"\} (\S+)$', re.M
)
CREDITED = re.compile(r"KV prefix decision.*?credited_prefix_tokens=(\d+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the router colours its log


@dataclass
class Session:
    system: str
    messages: list[dict[str, str]] = field(default_factory=list)
    last_prompt_tokens: int = 0

    def turn(self, client: httpx.Client, router: str, text: str) -> tuple[int, int]:
        """One turn; (prompt tokens, cached tokens). Raises on any status but 200."""
        self.messages.append({"role": "user", "content": text})
        body: dict[str, Any] = {
            "model": "default",
            "messages": [{"role": "system", "content": self.system}, *self.messages],
            "max_tokens": 8,
            "temperature": 0.0,
        }
        r = client.post(f"{router}/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        self.messages.append(
            {"role": "assistant", "content": data["choices"][0]["message"]["content"]}
        )
        usage = data["usage"]
        self.last_prompt_tokens = usage["prompt_tokens"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def served(base: str) -> int:
    """Chat completions this replica answered (its own counter)."""
    match = METRIC.search(httpx.get(f"{base}/metrics", timeout=10).text)
    return int(float(match.group(1))) if match else 0


def router_cmd(
    port: int, workers: list[str], events: list[tuple[int, int]], model: str
) -> list[str]:
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--worker-urls", *workers, "--policy", "kv_aware",
           "--kv-event-model", model, "--kv-event-block-size", str(BLOCK),
           "--prometheus-port", str(free_port()), "--log-level", "debug"]  # fmt: skip
    for url, (pub, replay) in zip(workers, events, strict=True):
        cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{pub}",
                "--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{replay}"]  # fmt: skip
    return cmd


def replica_args(model: Path, cache_dir: Path, pub: int, replay: int) -> list[str]:
    return ["--model", str(model), "--cache-dir", str(cache_dir),
            "--kv-events-endpoint", f"tcp://*:{pub}",
            "--kv-events-replay-endpoint", f"tcp://*:{replay}"]  # fmt: skip


def test_sessions_follow_their_cache_and_survive_a_replica(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    procs = ServerProcs(tmp_path)
    events = [(free_port(), free_port()) for _ in range(2)]
    try:
        launched = [
            procs.launch(replica_args(tiny_llama_dir, tmp_path / f"c{i}", *ports))
            for i, ports in enumerate(events)
        ]
        bases = [procs.wait(*one)[0] for one in launched]
        model = httpx.get(f"{bases[0]}/v1/models", timeout=10).json()["data"][0]["id"]
        port = free_port()
        url, router = procs.wait(*procs.launch_cmd(router_cmd(port, bases, events, model), port))
        router_log = procs.log_path(router)
        rule = "Rule {}: answer in one short line. "
        sessions = [Session(f"You are agent {i}. " + rule.format(i) * 12) for i in range(3)]
        with httpx.Client(timeout=120) as client:

            def round_(t: int, check: bool) -> None:
                for s in sessions:
                    before = s.last_prompt_tokens
                    prompt, cached = s.turn(client, url, f"Turn {t}: name a colour.")
                    if check:  # the previous prompt's full blocks were found where it ran
                        assert cached >= before // BLOCK * BLOCK, (t, prompt, cached, before)
                time.sleep(THINK_S)

            for t in range(3):
                round_(t, check=t > 0)
            credited = [
                int(n)
                for n in CREDITED.findall(ANSI.sub("", router_log.read_text(errors="replace")))
            ]
            assert max(credited, default=0) > 0, "the router never counted a cached prefix"

            counts = [served(b) for b in bases]
            assert sum(counts) == 9
            dead = counts.index(max(counts))
            survivor = bases[1 - dead]
            procs.kill9(dead)
            before_kill = served(survivor)
            round_(3, check=False)  # the dead replica's sessions start over on the survivor
            round_(4, check=True)
            assert served(survivor) - before_kill == 6, "a turn after the kill was lost"
    finally:
        procs.reap()
