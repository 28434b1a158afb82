"""The engine with `--attention-backend triton` (Triton interpreter on CPU) gives the same greedy
tokens as the torch backend, on a tiny random Llama with the real tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from deepinfer.config import CacheConfig, Config, DiskCacheConfig, ModelConfig, RuntimeConfig
from deepinfer.engine.core import EngineCore
from deepinfer.model.gguf_loader import open_gguf
from deepinfer.request import Request, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from deepinfer.environment import default_model_path
    from deepinfer.text.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    Tokenizer.from_gguf(open_gguf(default_model_path())).save_dir(path)
    return path


def _greedy(model_dir: Path, backend: str, prompts: list[list[int]]) -> list[list[int]]:
    config = Config(
        model=ModelConfig(path=model_dir, dtype="float32"),
        cache=CacheConfig(num_blocks=64, block_size=16, kv_dtype="float32"),  # Triton's, for both
        disk_cache=DiskCacheConfig(enabled=False),
        runtime=RuntimeConfig(device="cpu", attention_backend=backend),  # type: ignore[arg-type]
    )
    core = EngineCore(config)
    assert core.info.attention_backend == backend
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(Request(f"r{i}", list(ids), params))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_work:
        for delta in core.step():
            outputs[delta.request_id].extend(delta.token_ids)
        core.check_integrity()
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def test_triton_backend_matches_torch(tiny_llama_dir: Path) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    prompts = [list(range(100, 100 + n)) for n in (5, 17, 40)]
    prompts.append([*prompts[2][:33], 7, 8, 9])  # shares a two-block prefix with the third
    torch_tokens = _greedy(tiny_llama_dir, "torch", prompts)
    triton_tokens = _greedy(tiny_llama_dir, "triton", prompts)
    assert all(len(t) == 12 for t in torch_tokens)
    assert triton_tokens == torch_tokens
