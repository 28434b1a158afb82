"""Tensor parallel over NCCL, one GPU a rank (skipped with fewer than two): a tiny random Llama
split over 2 ranks gives one GPU's greedy tokens, and log-probabilities within 1e-4 with
float32 activations and KV."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.config import RuntimeConfig, TensorParallelConfig
from deepinfer.engine.async_engine import AsyncEngine
from tests.engine.test_tensor_parallel import close, config, run, write_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


async def test_nccl_ranks_agree_with_one_gpu(tmp_path: Path) -> None:
    model = write_model(tmp_path / "model", qk_norm=False)
    results = {}
    for ranks in (1, 2):
        serving = config(model, ranks).replace(
            runtime=RuntimeConfig(device="cuda", attention_backend="triton"),
            tensor_parallel=TensorParallelConfig(
                tensor_parallel=ranks, tensor_parallel_backend="nccl"
            ),
        )
        async with AsyncEngine(serving) as engine:
            results[ranks] = await run(engine)
    for (tokens, tops), (want_tokens, want_tops) in zip(results[2], results[1], strict=True):
        assert tokens == want_tokens
        assert close(tops, want_tops) <= 1e-4
