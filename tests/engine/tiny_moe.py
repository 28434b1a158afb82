"""Tiny random Mixture-of-Experts checkpoints written by transformers with SmolLM2's tokenizer
(the engine and GPU tests serve them), and transformers' own greedy tokens to compare with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepinfer.environment import default_model_path
from deepinfer.model.loading.gguf_loader import open_gguf
from deepinfer.text.tokenizer import Tokenizer


def qwen3_moe_config() -> Any:
    """Two layers of 8 experts, top 2."""
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
        tie_word_embeddings=True,
    )  # fmt: skip


def qwen2_moe_config() -> Any:
    """Three layers: two of 8 experts (top 3, ungated sums) beside a sigmoid-gated shared
    expert, and a dense one between them."""
    import transformers

    return transformers.Qwen2MoeConfig(
        vocab_size=49152, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=3, shared_expert_intermediate_size=64, mlp_only_layers=[1],
        norm_topk_prob=False, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip


def save_random(config: Any, scaled: tuple[str, ...], path: Path) -> tuple[Path, Any]:
    """A random model of `config` (parameters named with one of `scaled` and the embedding
    made large enough to matter: logits of order 1), saved with SmolLM2's tokenizer."""
    import transformers

    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if any(part in name for part in scaled):
                param.copy_(0.2 * torch.randn_like(param))
            elif "embed" in name:
                param.copy_(0.5 * torch.randn_like(param))
    hf_model.eval()
    hf_model.save_pretrained(path, safe_serialization=True)
    Tokenizer.from_gguf(open_gguf(default_model_path())).save_dir(path)
    return path, hf_model


def hf_greedy(hf_model: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, `n` tokens."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            next_id = hf_model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()
