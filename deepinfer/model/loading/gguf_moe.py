"""The Mixture-of-Experts part of a GGUF file as llama.cpp writes it: the experts of a layer
stacked in one tensor per projection, shared experts, and the router's metadata."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepinfer.errors import ModelLoadError
from deepinfer.model.arch import MoEArch

MOE_LAYER_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
"""A layer's router, its choosing bias and shared expert(s): GGUF -> canonical name."""
EXPERT_STACKS = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
"""A layer's experts, stacked in one 3D tensor each ([E, rows, columns]): read per expert as
`layers.N.mlp.experts.j.<proj>.weight`."""
SIGMOID_GATING = 2
"""llama.cpp's `expert_gating_func` for sigmoid scores (1: softmax)."""

Field = Callable[..., Any]
"""(key, default) -> a metadata value."""


def moe_fields(field: Field, key: str, name: str, tensors: dict[str, Any]) -> MoEArch:
    """The experts, as llama.cpp reads them: top k of `expert_count`; softmax scores, or sigmoid
    ones with a choosing bias and groups (dots.llm1, DeepSeek-V3); gates renormalized by
    default but for Qwen2-MoE (whose shared expert is sigmoid-gated) and DeepSeek (whose files
    say); a layer without a router is dense."""
    if "blk.0.ffn_gate.0.weight" in tensors:
        raise ModelLoadError("experts stored one tensor each (an old Mixtral GGUF) are not read")
    layers = int(field(f"{key}.block_count"))
    width = int(
        field(f"{key}.expert_feed_forward_length", 0) or field(f"{key}.feed_forward_length")
    )
    dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors)
    sparse = next((i for i in range(layers) if i not in dense), 0)
    shared = int(field(f"{key}.expert_shared_feed_forward_length", 0) or 0) or width * int(
        field(f"{key}.expert_shared_count", 0) or 0
    )
    sigmoid = int(field(f"{key}.expert_gating_func", 0) or 0) == SIGMOID_GATING
    return MoEArch(
        num_experts=int(field(f"{key}.expert_count")),
        top_k=int(field(f"{key}.expert_used_count")),
        expert_intermediate_size=width,
        routing="sigmoid_topk" if sigmoid else "softmax_topk",
        renormalize=bool(
            field(f"{key}.expert_weights_norm", name not in ("qwen2_moe", "deepseek_v3"))
        ),
        routed_scaling=float(field(f"{key}.expert_weights_scale", 0.0) or 1.0),
        shared_intermediate_size=shared,
        shared_gate=f"blk.{sparse}.ffn_gate_inp_shexp.weight" in tensors,
        dense_layers=dense,
        score_bias=f"blk.{sparse}.exp_probs_b.bias" in tensors,
        num_groups=int(field(f"{key}.expert_group_count", 0) or 1),
        topk_groups=int(field(f"{key}.expert_group_used_count", 0) or 1),
    )
