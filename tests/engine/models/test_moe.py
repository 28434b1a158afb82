"""A tiny random Qwen3-MoE served by the engine: ten requests at once, prefill and decode on their
own workers, give the greedy tokens transformers generates one request at a time (the experts see
other requests' tokens in every step); the tokens routed to each expert are counted, in /metrics."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from deepinfer.api.ops.metrics import ApiMetrics
from deepinfer.config import Config, RuntimeConfig, WorkersConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.build_replicas import capture_graphs
from deepinfer.errors import ConfigError
from deepinfer.model.arch import MoEArch
from tests.engine.tiny_engine import GREEDY, run_all, tiny_config, token_prompts
from tests.engine.tiny_moe import hf_greedy, qwen3_moe_config, save_random

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return save_random(qwen3_moe_config(), (".mlp.",), tmp_path_factory.mktemp("tiny-qwen3-moe"))


@pytest.mark.slow
async def test_moe_engine_equals_transformers(tiny_moe: tuple[Path, Any]) -> None:
    path, hf_model = tiny_moe
    prompts = token_prompts()
    async with AsyncEngine(tiny_config(path, WorkersConfig())) as engine:
        got = await run_all(engine, prompts)
        engine.check_integrity()
        stats = engine.stats()
        metrics = ApiMetrics(engine).render().decode()
    want = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]
    assert got == want
    # every token forwarded (prompt tokens computed, then each decode input) went to 2 experts
    # in each of the 2 layers
    forwarded = stats.prefill_counts.num_computed_tokens + len(prompts) * (GREEDY.max_tokens - 1)
    assert [sum(layer) for layer in stats.expert_load] == [2 * forwarded] * 2
    assert all(len(layer) == 8 for layer in stats.expert_load)
    n = stats.expert_load[1][7]
    assert f'deepinfer_moe_expert_tokens_total{{expert="7",layer="1"}} {float(n)}' in metrics


def test_moe_models_decode_without_cuda_graphs() -> None:
    """The experts' row counts change every step: no static decode graph is captured."""
    moe = MoEArch(num_experts=4, top_k=2, expert_intermediate_size=8)
    replica: Any = SimpleNamespace(
        window=None, model=SimpleNamespace(arch=SimpleNamespace(moe=moe))
    )
    with pytest.raises(ConfigError, match="Mixture-of-Experts"):
        capture_graphs(Config(runtime=RuntimeConfig(cuda_graphs="on")), replica, 64)
    assert capture_graphs(Config(), replica, 64) is None


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """DeepSeek-V3's latent attention (expanded into the paged caches: 4 KV heads of 32) and
    grouped sigmoid routing."""
    config = transformers.DeepseekV3Config(
        vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    return save_random(config, (".mlp.", "_proj"), tmp_path_factory.mktemp("tiny-deepseek"))


@pytest.mark.slow
async def test_deepseek_engine_equals_transformers(tiny_deepseek: tuple[Path, Any]) -> None:
    """Through the engine (disaggregated workers, the prefix cache on): the greedy tokens of
    transformers, and a second run of the same prompts served from cached latent-attention KV."""
    path, hf_model = tiny_deepseek
    prompts = token_prompts()
    async with AsyncEngine(tiny_config(path, WorkersConfig())) as engine:
        got = await run_all(engine, prompts)
        again = await run_all(engine, prompts)
        engine.check_integrity()
        cached = engine.stats().prefill_counts
    want = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]
    assert got == want and again == want
    assert cached.num_computed_tokens < 2 * sum(len(p) for p in prompts)
