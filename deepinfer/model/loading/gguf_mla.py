"""Latent attention in a GGUF file as llama.cpp writes DeepSeek-V2/V3 (`deepseek2`): its
tensors' names, the latent ranks and head sizes, and YaRN's RoPE scaling.

Files whose converter split `kv_b_proj` into `attn_k_b` and `attn_v_b` (the absorbed form
llama.cpp computes with) are read back into the one projection. A head's key is
`key_length` (or `key_length_mla` in that form) wide, its rotary part `rope.dimension_count`;
the rotary rows stay in the interleaved pairs of DeepSeek's checkpoints (llama.cpp rotates
adjacent pairs for this architecture), which the weights loader reorders as for safetensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from deepinfer.errors import ModelLoadError
from deepinfer.model.arch import MLAArch, YarnRope
from deepinfer.model.rope import yarn_mscale

MLA_LAYER_NAMES = {
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_k_b.weight": "self_attn.k_b_proj.weight",
    "attn_v_b.weight": "self_attn.v_b_proj.weight",
}
"""A latent-attention layer's tensors: GGUF -> canonical name."""

Field = Callable[..., Any]
"""(key, default) -> a metadata value."""


def mla_fields(field: Field, key: str, num_heads: int) -> dict[str, Any]:
    """`ModelArch` fields of a `deepseek2` file: the latent attention, as many KV heads as query
    heads, the key's width, YaRN and the softmax scale it implies."""
    rope = int(field(f"{key}.rope.dimension_count"))
    head_dim = int(
        field(f"{key}.attention.key_length_mla", 0) or field(f"{key}.attention.key_length")
    )
    v_head_dim = int(
        field(f"{key}.attention.value_length_mla", 0) or field(f"{key}.attention.value_length")
    )
    mla = MLAArch(
        kv_lora_rank=int(field(f"{key}.attention.kv_lora_rank")),
        qk_nope_head_dim=head_dim - rope,
        qk_rope_head_dim=rope,
        v_head_dim=v_head_dim,
        q_lora_rank=int(field(f"{key}.attention.q_lora_rank", 0) or 0),
    )
    yarn, scale = gguf_yarn(field, key), head_dim**-0.5
    log_mul = float(field(f"{key}.rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
    if yarn is not None and log_mul:  # llama.cpp: kq_scale (1 + log_mul ln factor)^2 / sqrt(dk)
        scale *= yarn_mscale(yarn.factor, log_mul / 0.1) ** 2
    return {
        "mla": mla,
        "head_dim": head_dim,
        "num_kv_heads": num_heads,
        "query_scale": scale,
        "rope_yarn": yarn,
    }


def gguf_yarn(field: Field, key: str) -> YarnRope | None:
    """YaRN from `rope.scaling.*` (None without it). Its attention factor is 1: DeepSeek's
    releases scale cos and sin by mscale / mscale_all_dim, equal in every one of them."""
    if field(f"{key}.rope.scaling.type", "none") != "yarn":
        return None
    return YarnRope(
        factor=float(field(f"{key}.rope.scaling.factor")),
        original_max_positions=int(field(f"{key}.rope.scaling.original_context_length")),
        beta_fast=float(field(f"{key}.rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(field(f"{key}.rope.scaling.yarn_beta_slow", 1.0)),
    )


def joined_kv_b(k_b: np.ndarray, v_b: np.ndarray, num_heads: int) -> np.ndarray:
    """`kv_b_proj` [H (nope + v), rank] from llama.cpp's split form: k_b [H, nope, rank] stored
    transposed per head ([H, rank, nope]), v_b [H, v, rank]."""
    if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[0] != num_heads:
        raise ModelLoadError(f"attn_k_b {k_b.shape} and attn_v_b {v_b.shape} do not pair up")
    k = np.swapaxes(k_b, 1, 2)  # [H, nope, rank]
    return np.concatenate([k, v_b], axis=1).reshape(-1, v_b.shape[2])
