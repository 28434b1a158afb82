"""Expert parallelism through the engine: a tiny Qwen3-MoE served with its experts over 1, 2 and 4
groups of this process, with replicas re-placed every few steps while requests stream, and over
2 processes joined by torch.distributed (gloo), gives the same tokens as with every expert in
one place; nothing is dropped and the ranks stop with the engine."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from deepinfer.api.ops.metrics import ApiMetrics
from deepinfer.config import Config, ExpertsConfig, WorkersConfig, check_expert_layout
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.build_experts import build_expert_parallel
from deepinfer.errors import ConfigError
from deepinfer.model import load_model
from tests.engine.models.test_moe import tiny_moe  # noqa: F401  (the module's fixture)
from tests.engine.tiny_engine import run_all, tiny_config, token_prompts

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


def _config(path: Path, experts: ExpertsConfig) -> Config:
    return tiny_config(path, WorkersConfig()).replace(experts=experts)


async def _tokens(config: Config) -> tuple[list[list[int]], Any]:
    async with AsyncEngine(config) as engine:
        tokens = await run_all(engine, token_prompts())
        engine.check_integrity()
        stats = engine.stats()
        metrics = ApiMetrics(engine).render().decode()
    ep = stats.expert_parallel
    if ep is not None:  # every routed row computed by exactly one group
        assert sum(ep.group_rows) == sum(map(sum, stats.expert_load))
        assert f"deepinfer_moe_expert_groups {float(ep.num_groups)}" in metrics
        assert f"deepinfer_moe_placement_swaps_total {float(ep.swaps)}" in metrics
        for layer, replicas in ep.replicas.items():
            assert sum(replicas) == 8 + config.experts.redundant_experts
            n = replicas[0]
            assert (
                f'deepinfer_moe_expert_replicas{{expert="0",layer="{layer}"}} {float(n)}' in metrics
            )
    return tokens, ep


@pytest.fixture(scope="module")
async def alone(tiny_moe: tuple[Path, Any]) -> list[list[int]]:  # noqa: F811
    tokens, stats = await _tokens(_config(tiny_moe[0], ExpertsConfig()))
    assert stats is None  # no groups without the flags
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize(
    "experts",
    [
        ExpertsConfig(expert_parallel=2),
        ExpertsConfig(expert_parallel=4, redundant_experts=4, eplb_interval=3),
        ExpertsConfig(expert_parallel=2, redundant_experts=2, eplb_interval=1),
    ],
    ids=["2-groups", "4-groups-eplb", "2-groups-eplb-every-step"],
)
async def test_groups_give_the_same_tokens(
    tiny_moe: tuple[Path, Any],  # noqa: F811
    alone: list[list[int]],
    experts: ExpertsConfig,
) -> None:
    tokens, ep = await _tokens(_config(tiny_moe[0], experts))
    assert tokens == alone
    assert ep.steps > 10 and ep.num_groups == experts.expert_parallel
    assert all(ep.group_rows)  # every group took part
    if experts.eplb_interval:  # placements swapped while the requests streamed
        assert ep.swaps > 0 and ep.rebalances == ep.steps // experts.eplb_interval


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
async def test_two_gloo_processes_give_the_same_tokens(
    tiny_moe: tuple[Path, Any],  # noqa: F811
    alone: list[list[int]],
) -> None:
    experts = ExpertsConfig(
        expert_parallel=2, expert_parallel_backend="gloo", redundant_experts=2, eplb_interval=4,
        master_port=_free_port(),
    )  # fmt: skip
    async with AsyncEngine(_config(tiny_moe[0], experts)) as engine:
        tokens = await run_all(engine, token_prompts())
        parallel = engine.core.experts
        assert parallel is not None
        (process,) = [p for p in multiprocessing.active_children() if p.name == "deepinfer-rank1"]
        swaps = parallel.stats.swaps
    assert tokens == alone
    assert swaps > 0
    process.join(10)
    assert process.exitcode == 0  # told to stop by rank 0, not killed


def test_experts_must_fill_the_groups(tiny_moe: tuple[Path, Any]) -> None:  # noqa: F811
    path = tiny_moe[0]
    model = load_model(path, torch.float32, "cpu").model
    with pytest.raises(ConfigError, match="do not divide evenly"):
        build_expert_parallel(_config(path, ExpertsConfig(expert_parallel=3)), path, [model])
    # 8 experts and 1 replica fill 3 groups of 3 slots
    config = _config(path, ExpertsConfig(expert_parallel=3, redundant_experts=1))
    parallel = build_expert_parallel(config, path, [model])
    assert parallel is not None and parallel.num_groups == 3
    assert all(len(group) == 3 for group in parallel.placements[0].groups)
    parallel.close()


@pytest.mark.slow
async def test_a_second_machine_joins_with_the_serve_command(
    tiny_moe: tuple[Path, Any],  # noqa: F811
    alone: list[list[int]],
) -> None:
    """Two "machines" (nodes) of one rank each: node 1 runs `deepinfer serve --node-rank 1`, as
    on another host, which starts its rank and waits; node 0 serves. The tokens are the same and
    node 1's command ends when node 0 shuts down."""
    path, port = tiny_moe[0], _free_port()
    flags = [
        "--expert-parallel", "2", "--expert-parallel-backend", "gloo", "--nnodes", "2",
        "--master-port", str(port), "--dtype", "float32",
    ]  # fmt: skip
    node1 = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "deepinfer.cli", "serve", "--model", str(path), *flags,
        "--node-rank", "1", "--no-disk-cache",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    experts = ExpertsConfig(
        expert_parallel=2, expert_parallel_backend="gloo", nnodes=2, master_port=port
    )
    try:
        tokens, ep = await _tokens(_config(path, experts))
        out, _ = await asyncio.wait_for(node1.communicate(), timeout=60)
    finally:
        if node1.returncode is None:
            node1.kill()
            await node1.wait()
    assert tokens == alone
    assert ep.group_rows[1] > 0  # node 1's rank computed rows
    assert node1.returncode == 0, out.decode()


@pytest.mark.parametrize(
    ("experts", "message"),
    [
        (ExpertsConfig(expert_parallel=2, expert_devices=("cpu",)), "names 1 devices"),
        (ExpertsConfig(expert_parallel=2, nnodes=2), "needs --expert-parallel-backend"),
        (ExpertsConfig(expert_parallel=3, expert_parallel_backend="gloo", nnodes=2), "divide"),
        (ExpertsConfig(expert_parallel=2, expert_parallel_backend="gloo", node_rank=1), "not in"),
    ],
)
def test_flags_that_disagree_are_refused(experts: ExpertsConfig, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_expert_layout(experts)
    check_expert_layout(ExpertsConfig(expert_parallel=4, expert_parallel_backend="nccl", nnodes=2))


@pytest.mark.slow
async def test_a_rank_that_dies_is_stood_in_for(
    tiny_moe: tuple[Path, Any],  # noqa: F811
    alone: list[list[int]],
) -> None:
    """The rank's process is killed between two batches of requests: the next exchange fails,
    the serving process computes that rank's experts from then on (it holds every expert), and
    every request still gets the unparallel tokens; shutdown does not wait on the dead rank."""
    experts = ExpertsConfig(
        expert_parallel=2, expert_parallel_backend="gloo", master_port=_free_port()
    )
    async with AsyncEngine(_config(tiny_moe[0], experts)) as engine:
        first = await run_all(engine, token_prompts())
        (process,) = [p for p in multiprocessing.active_children() if p.name == "deepinfer-rank1"]
        process.kill()
        process.join(10)
        second = await run_all(engine, token_prompts())
        engine.check_integrity()
        stats = engine.stats()
        metrics = ApiMetrics(engine).render().decode()
    assert first == alone and second == alone
    assert stats.expert_parallel is not None and stats.expert_parallel.failed_groups == (1,)
    assert "deepinfer_moe_failed_groups 1.0" in metrics


def _serve(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, str(ROOT / "server.py"), "--port", str(port), "--no-disk-cache", *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start: {log.read_text()[-2000:]}")


def _chat(base: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    texts = []
    for question in ("Name three colors.", "What is two plus two?"):
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": question}], max_tokens=16,
            temperature=0.0,
        )  # fmt: skip
        texts.append(reply.choices[0].message.content or "")
    return texts


@pytest.mark.slow
def test_the_server_with_expert_ranks(tiny_moe: tuple[Path, Any], tmp_path: Path) -> None:  # noqa: F811
    """`server.py` with 2 gloo ranks and EPLB answers the official client as the server without
    them does, reports its groups in /metrics, and on SIGTERM stops its rank and exits 0."""
    model = ["--model", str(tiny_moe[0]), "--dtype", "float32"]
    ep = ["--expert-parallel", "2", "--expert-parallel-backend", "gloo", "--redundant-experts",
          "2", "--eplb-interval", "4", "--master-port", str(_free_port())]  # fmt: skip
    plain, base = _serve(model, tmp_path / "plain.log")
    try:
        want = _chat(base)
    finally:
        plain.kill()
        plain.wait(30)
    proc, base = _serve(model + ep, tmp_path / "ep.log")
    try:
        got = _chat(base)
        metrics = httpx.get(f"{base}/metrics").text
        ranks = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "ep.log").read_text()
    assert got == want and all(got)
    assert "deepinfer_moe_expert_groups 2.0" in metrics
    # uvicorn ends a graceful shutdown by re-raising the signal; the rank was stopped, not killed
    assert proc.returncode in (0, -signal.SIGTERM) and "Application shutdown complete" in log
    # the rank is joined before the server exits; multiprocessing's resource tracker, also a
    # child, leaves once it sees its parent gone (a moment later on a loaded machine)
    deadline = time.monotonic() + 20
    while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ranks and not any(_running(pid) for pid in ranks)
    assert "Traceback" not in log and "terminating it" not in log, log[-2000:]


def _running(pid: int) -> bool:
    """The process is alive (not gone, nor a zombie waiting to be reaped)."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return found
