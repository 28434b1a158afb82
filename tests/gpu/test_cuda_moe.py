"""A Mixture of Experts on a CUDA device (skipped where there is none): a tiny Qwen3-MoE on the
triton backend (every expert's rows in one grouped launch) gives transformers' greedy tokens,
and so do its experts over 2 groups with EPLB (one GPU each where there are two, else both on
the one: each group on a stream of its own)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer.config import (
    CacheConfig,
    Config,
    DiskCacheConfig,
    ExpertsConfig,
    ModelConfig,
    RuntimeConfig,
    SchedulerConfig,
)
from deepinfer.engine.core import EngineCore
from deepinfer.request import Request, SamplingParams
from tests.engine.tiny_moe import hf_greedy, qwen3_moe_config, save_random

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
transformers = pytest.importorskip("transformers")
PROMPTS = [[(i * 37 + j * 11) % 5000 + 100 for j in range(5 + 23 * (i % 4))] for i in range(6)]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return save_random(qwen3_moe_config(), (".mlp.",), tmp_path_factory.mktemp("cuda-moe"))


def _greedy(path: Path, experts: ExpertsConfig, n: int = 12) -> list[list[int]]:
    config = Config(
        model=ModelConfig(path=path, dtype="float32"),
        cache=CacheConfig(num_blocks=256, kv_dtype="float32"),
        disk_cache=DiskCacheConfig(enabled=False),
        scheduler=SchedulerConfig(max_num_seqs=8),
        runtime=RuntimeConfig(device="cuda", attention_backend="triton"),
        experts=experts,
    )
    core = EngineCore(config)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(PROMPTS):
        core.add_request(Request(f"r{i}", ids, params))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while core.has_work:
        for delta in core.step():
            out[delta.request_id].extend(delta.token_ids)
    core.close()
    return [out[f"r{i}"] for i in range(len(PROMPTS))]


def test_moe_on_cuda_equals_transformers(tiny_moe: tuple[Path, Any]) -> None:
    path, hf_model = tiny_moe
    assert _greedy(path, ExpertsConfig()) == [hf_greedy(hf_model, p, 12) for p in PROMPTS]


def test_expert_groups_on_cuda_give_the_same_tokens(tiny_moe: tuple[Path, Any]) -> None:
    path, _ = tiny_moe
    groups = ExpertsConfig(expert_parallel=2, redundant_experts=2, eplb_interval=2)
    assert _greedy(path, groups) == _greedy(path, ExpertsConfig())
