"""Separate device groups on CPU (`cpu:0` for prefill, `cpu:1` for decode): two model replicas,
two KV pools, and every prefilled request's KV copied between them on the transfer thread.

The copy path is the one CUDA devices take (streams aside), so these tests pin what it must keep:
the tokens of the shared-pool engine, greedy and seeded; the prefix cache on the prefill pool;
aborts at any point (including during a copy) leaking no block in either pool; clear refusals.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from deepinfer.api.ops.worker_metrics import worker_metrics
from deepinfer.config import WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.core import EngineCore
from deepinfer.errors import ConfigError
from deepinfer.request import Request, SamplingParams
from deepinfer.runner.kv_handoff import KVCopier
from deepinfer.scheduler.disagg import DisaggScheduler
from tests.engine.tiny_engine import leave_after, run_all, settle, tiny_config, token_prompts

SPLIT = WorkersConfig(
    prefill_devices=("cpu:0",),
    decode_devices=("cpu:1",),
    prefill_step_ms=5.0,
    prefill_buckets=(16, 48),
)
SHARED = WorkersConfig(prefill_step_ms=5.0, prefill_buckets=(16, 48))


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=7, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
async def test_split_groups_give_the_shared_pool_tokens(
    tiny_llama_dir: Path, params: SamplingParams
) -> None:
    results = {}
    for name, workers in (("shared", SHARED), ("split", SPLIT)):
        async with AsyncEngine(tiny_config(tiny_llama_dir, workers)) as engine:
            results[name] = await run_all(engine, token_prompts(), params)
            engine.check_integrity()
            stats = engine.stats()
            assert stats.num_blocks_used == 0 and stats.decode_blocks_used == 0
            if name == "split":
                core = engine.core
                assert core.decode_kv is not None and core.decode_runner is not core.runner
                assert core.decode_runner.model is not core.runner.model, "one replica each"
                assert engine.info.decode_device == torch.device("cpu")
                assert stats.decode_blocks_total == 96
                assert stats.handoffs.num_handoffs == len(token_prompts())
                assert stats.handoffs.num_blocks >= len(token_prompts())
                names = {m.name for m in worker_metrics(stats)}
                assert {"deepinfer_kv_handoffs", "deepinfer_kv_handoff_seconds"} <= names
                assert all(w.num_steps > 0 for w in stats.workers)
    assert results["split"] == results["shared"]
    assert all(len(r) == params.max_tokens for r in results["split"])


async def test_prefix_cache_lives_on_the_prefill_pool(tiny_llama_dir: Path) -> None:
    prompt = [(j * 13) % 5000 + 100 for j in range(70)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(tiny_config(tiny_llama_dir, SPLIT)) as engine:
        cached = []
        tokens = []
        for _ in range(2):
            out: list[int] = []
            async for delta in engine.generate(prompt, params):
                out.extend(delta.token_ids)
                last = delta
            cached.append(last.usage.cached_tokens)
            tokens.append(out)
        assert cached[0] == 0 and cached[1] == 64, cached  # four full blocks of 16
        assert tokens[0] == tokens[1]
        engine.check_integrity()


async def test_aborts_anywhere_leak_nothing(tiny_llama_dir: Path) -> None:
    """Clients leave after 1-5 tokens, some while their KV is being copied; a small decode
    pool makes handoffs wait for blocks too."""
    config = tiny_config(tiny_llama_dir, SPLIT, num_blocks=24)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(config) as engine:
        prompts = token_prompts() * 2
        counts = await asyncio.gather(
            *(leave_after(engine, p, params, 1 + i % 5) for i, p in enumerate(prompts))
        )
        assert all(c >= 1 for c in counts)
        await settle(engine)
        engine.check_integrity()
        stats = engine.stats()
        assert stats.num_blocks_used == 0 and stats.decode_blocks_used == 0
        sched = engine.core.scheduler
        assert isinstance(sched, DisaggScheduler)
        assert not sched.handing_off and not sched.handoff_waiting
        (again,) = await run_all(engine, token_prompts()[:1], params)
        assert len(again) == params.max_tokens


def test_offline_steps_copy_synchronously(tiny_llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = {}
    for name, workers in (("shared", SHARED), ("split", SPLIT)):
        core = EngineCore(tiny_config(tiny_llama_dir, workers))
        for i, ids in enumerate(token_prompts()[:4]):
            core.add_request(Request(f"r{i}", list(ids), params))
        got: dict[str, list[int]] = {}
        for _ in range(200):
            if not core.has_work:
                break
            for delta in core.step():
                got.setdefault(delta.request_id, []).extend(delta.token_ids)
        core.check_integrity()
        outputs[name] = got
    assert outputs["split"] == outputs["shared"] and len(outputs["split"]) == 4


def test_copier_copies_whole_blocks_between_pools() -> None:
    torch.manual_seed(0)
    src = [(torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8)) for _ in range(3)]
    dst = [(torch.zeros(5, 4, 2, 8), torch.zeros(5, 4, 2, 8)) for _ in range(3)]
    KVCopier(src, dst).copy([4, 1, 2], [0, 3, 1])
    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        for s, d in ((sk, dk), (sv, dv)):
            assert torch.equal(d[0], s[4]) and torch.equal(d[3], s[1]) and torch.equal(d[1], s[2])
            assert not d[2].any() and not d[4].any(), "a block outside the copy was written"
    with pytest.raises(ValueError, match="as many blocks"):
        KVCopier(src, dst).copy([1], [1, 2])
    with pytest.raises(ValueError, match="dtype"):
        KVCopier(src, [(k.half(), v.half()) for k, v in dst])
    with pytest.raises(ValueError, match="block shape"):
        KVCopier(src, [(k[:, :2], v[:, :2]) for k, v in dst])


@pytest.mark.parametrize(
    ("workers", "match"),
    [
        (WorkersConfig(prefill_devices=("cpu:0", "cpu:1")), "one device per group"),
        (WorkersConfig(colocated=True, decode_devices=("cpu:1",)), "colocated"),
        (WorkersConfig(decode_devices=("cuda:0",)), "decode-devices cuda:0"),
        (WorkersConfig(prefill_devices=("tpu",)), "prefill-devices tpu"),
    ],
)
def test_groups_this_version_cannot_run_are_refused(
    tiny_llama_dir: Path, workers: WorkersConfig, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineCore(tiny_config(tiny_llama_dir, workers))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("src_device", ["cpu", "cuda"])
def test_copier_on_transfer_streams(src_device: str) -> None:
    """The CUDA path: copies on the copier's own streams, complete when `copy` returns, while
    the default stream is left alone (on one GPU both pools may even share the device)."""
    src = [(torch.randn(6, 4, 2, 8, device=src_device),) * 2 for _ in range(2)]
    dst = [(torch.zeros(5, 4, 2, 8, device="cuda"), torch.zeros(5, 4, 2, 8, device="cuda"))]
    dst.append((torch.zeros(5, 4, 2, 8, device="cuda"), torch.zeros(5, 4, 2, 8, device="cuda")))
    copier = KVCopier(src, dst)
    assert copier._streams and all(s != torch.cuda.current_stream() for s in copier._streams)
    copier.copy([5, 0], [2, 4])
    for (sk, _), (dk, dv) in zip(src, dst, strict=True):
        assert torch.equal(dk[2].cpu(), sk[5].cpu()) and torch.equal(dv[4].cpu(), sk[0].cpu())
