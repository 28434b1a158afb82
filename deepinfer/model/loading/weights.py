"""Turn a checkpoint's tensors (under canonical names) into the model's fused state dict.

Canonical names are Hugging Face's Llama names without the `model.` prefix
(`embed_tokens.weight`, `layers.3.self_attn.q_proj.weight`, `norm.weight`, `lm_head.weight`;
Gemma 3 adds `pre_feedforward_layernorm` and `post_feedforward_layernorm`; a Mixture-of-Experts
layer has Qwen-MoE's `mlp.gate` (the router), `mlp.experts.j.{gate,up,down}_proj` and
`mlp.shared_expert.*`, `mlp.shared_expert_gate`). Loaders map their
own names to these and hand over one tensor at a time, in the Hugging Face (rotate-half RoPE)
layout, norm weights as the factor they multiply by (Gemma's checkpoints store w for 1 + w:
their loader adds the 1, as llama.cpp's converter does).
"""

from __future__ import annotations

from typing import Protocol

import torch
from tqdm import tqdm

from deepinfer.errors import ModelLoadError
from deepinfer.model.arch import MLAArch, ModelArch, MoEArch

StateDict = dict[str, torch.Tensor]


class TensorSource(Protocol):
    """Checkpoint tensors under canonical names, materialized one at a time."""

    def names(self) -> set[str]: ...

    def load(self, name: str) -> torch.Tensor:
        """The tensor (any float dtype, on CPU); raises ModelLoadError if absent or unreadable."""
        ...


_SERVED = torch.empty(0, device="meta")
"""What `_Taker` gives for tensors served elsewhere (from their blocks): left out of the state."""


class _Taker:
    """Loads tensors from a source in the serving dtype, remembering which were used."""

    def __init__(
        self,
        source: TensorSource,
        dtype: torch.dtype,
        device: torch.device,
        served: frozenset[str] = frozenset(),
    ) -> None:
        self.source, self.dtype, self.device, self.served = source, dtype, device, served
        self.used: set[str] = set()

    def __call__(self, *names: str) -> torch.Tensor:
        """One tensor, or several concatenated along dim 0 (fused projections); `_SERVED` when
        every one is served from blocks (not read)."""
        parts = []
        for name in names:
            if name not in self.source.names():
                raise ModelLoadError(f"the checkpoint has no tensor {name!r}")
            self.used.add(name)
        if self.served.issuperset(names):
            return _SERVED
        for name in names:
            parts.append(self.source.load(name))
        fused = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return fused.to(device=self.device, dtype=self.dtype)


def linear_sources(i: int) -> dict[str, tuple[str, ...]]:
    """Layer i's linear modules (model names) and the canonical weights fused into each, in
    row order."""
    src, dst = f"layers.{i}.", f"layers.{i}."
    attn = src + "self_attn."
    return {
        dst + "self_attn.qkv_proj": (
            attn + "q_proj.weight",
            attn + "k_proj.weight",
            attn + "v_proj.weight",
        ),
        dst + "self_attn.o_proj": (attn + "o_proj.weight",),
        dst + "mlp.gate_up_proj": (src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"),
        dst + "mlp.down_proj": (src + "mlp.down_proj.weight",),
    }


def shared_expert_sources(i: int) -> dict[str, tuple[str, ...]]:
    """Layer i's shared expert (a Mixture-of-Experts layer's), as `linear_sources`."""
    theirs, ours = f"layers.{i}.mlp.shared_expert.", f"layers.{i}.mlp.shared."
    return {
        ours + "gate_up_proj": (theirs + "gate_proj.weight", theirs + "up_proj.weight"),
        ours + "down_proj": (theirs + "down_proj.weight",),
    }


_NORMS = {"input_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}
_SANDWICH_NORMS = _NORMS | {
    "pre_ffn_norm": "pre_feedforward_layernorm",
    "post_ffn_norm": "post_feedforward_layernorm",
}
"""Gemma 3 normalizes each block's input and output: four norms a layer."""


def norm_sources(arch: ModelArch, i: int) -> dict[str, str]:
    """Layer i's norm weights (model names) and their canonical names."""
    names = _SANDWICH_NORMS if arch.architecture == "gemma3" else _NORMS
    p = f"layers.{i}."
    return {p + ours + ".weight": p + theirs + ".weight" for ours, theirs in names.items()}


def _layer_state(arch: ModelArch, take: _Taker, i: int) -> StateDict:
    src, dst = f"layers.{i}.", f"layers.{i}."
    attn = src + "self_attn."
    state = {ours: take(theirs) for ours, theirs in norm_sources(arch, i).items()}
    for module, names in linear_sources(i).items():
        if (arch.sparse(i) and ".mlp." in module) or (arch.mla and module.endswith("qkv_proj")):
            continue
        state[module + ".weight"] = take(*names)
    if arch.mla is not None:
        state.update(_mla_state(arch, arch.mla, take, i))
    if arch.moe is not None and arch.sparse(i):
        state.update(_expert_state(arch.moe, take, i))
    if arch.qkv_bias:
        state[dst + "self_attn.qkv_proj.bias"] = take(
            attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"
        )
    if arch.qk_norm:
        state[dst + "self_attn.q_norm.weight"] = take(attn + "q_norm.weight")
        state[dst + "self_attn.k_norm.weight"] = take(attn + "k_norm.weight")
    return state


def deinterleave_rows(weight: torch.Tensor, width: int, start: int, rope: int) -> torch.Tensor:
    """`weight`'s rows in blocks of `width`, each block's rows [start, start + rope) reordered
    from interleaved pairs (x0, x1), (x2, x3)... to halves (x0, x2, ...; x1, x3, ...)."""
    order = torch.arange(weight.shape[0]).view(-1, width)
    part = order[:, start : start + rope]
    order[:, start : start + rope] = torch.cat([part[:, 0::2], part[:, 1::2]], dim=1)
    return weight[order.reshape(-1)]


def _mla_state(arch: ModelArch, mla: MLAArch, take: _Taker, i: int) -> StateDict:
    """A latent-attention layer's projections and norms (DeepSeek's names), the rotary rows of
    the query and of the shared key reordered from interleaved pairs into halves."""
    ours, theirs = f"layers.{i}.self_attn.", f"layers.{i}.self_attn."
    rope, nope = mla.qk_rope_head_dim, mla.qk_nope_head_dim

    def rotary(weight: torch.Tensor, width: int, start: int) -> torch.Tensor:
        if weight is _SERVED or not mla.interleaved_rope:
            return weight
        return deinterleave_rows(weight, width, start, rope)

    q = ("q_b_proj", "q_b_proj") if mla.q_lora_rank else ("q_proj", "q_proj")
    state = {
        ours + q[0] + ".weight": rotary(take(theirs + q[1] + ".weight"), arch.head_dim, nope),
        ours + "kv_a_proj.weight": rotary(
            take(theirs + "kv_a_proj_with_mqa.weight"), mla.kv_lora_rank + rope, mla.kv_lora_rank
        ),
        ours + "kv_a_norm.weight": take(theirs + "kv_a_layernorm.weight"),
        ours + "kv_b_proj.weight": take(theirs + "kv_b_proj.weight"),
    }
    if mla.q_lora_rank:
        state[ours + "q_a_proj.weight"] = take(theirs + "q_a_proj.weight")
        state[ours + "q_a_norm.weight"] = take(theirs + "q_a_layernorm.weight")
    return state


def _expert_state(moe: MoEArch, take: _Taker, i: int) -> StateDict:
    """A sparse layer's router, experts stacked as [E, 2I, D] and [E, D, I], and shared expert.
    Canonical names are Qwen-MoE's (`mlp.gate` is the router, `mlp.experts.j.*_proj`)."""
    mlp = f"layers.{i}.mlp."
    experts = [f"{mlp}experts.{j}." for j in range(moe.num_experts)]
    state = {
        mlp + "router.weight": take(mlp + "gate.weight"),
        mlp + "w_gate_up": _stacked(
            [take(e + "gate_proj.weight", e + "up_proj.weight") for e in experts]
        ),
        mlp + "w_down": _stacked([take(e + "down_proj.weight") for e in experts]),
    }
    if moe.score_bias:  # chooses experts, kept in float32 as DeepSeek's reference does
        state[mlp + "router_bias"] = take(mlp + "gate.e_score_correction_bias").float()
    if moe.shared_intermediate_size:
        shared = mlp + "shared_expert."
        state[mlp + "shared.gate_up_proj.weight"] = take(
            shared + "gate_proj.weight", shared + "up_proj.weight"
        )
        state[mlp + "shared.down_proj.weight"] = take(shared + "down_proj.weight")
        if moe.shared_gate:
            state[mlp + "shared.gate.weight"] = take(mlp + "shared_expert_gate.weight")
    return state


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    return _SERVED if all(p is _SERVED for p in parts) else torch.stack(parts)


def build_state_dict(
    arch: ModelArch,
    source: TensorSource,
    dtype: torch.dtype,
    device: torch.device,
    desc: str = "loading weights",
    ignored: frozenset[str] = frozenset(),
    served: frozenset[str] = frozenset(),
) -> StateDict:
    """The model's state dict; every source tensor must be used (or listed in `ignored`).

    An unused tensor means a feature this implementation does not have (rope scaling factors,
    output biases...): loading refuses rather than serve a subtly different model. Tensors in
    `served` (the model serves them from their blocks) count as used, are never read, and their
    entries are left out.
    """
    take = _Taker(source, dtype, device, served)
    state: StateDict = {"embed_tokens.weight": take("embed_tokens.weight")}
    for i in tqdm(range(arch.num_layers), desc=desc, unit="layer", leave=False):
        state.update(_layer_state(arch, take, i))
    state["norm.weight"] = take("norm.weight")
    if not arch.tie_word_embeddings:
        state["lm_head.weight"] = take("lm_head.weight")
    if arch.tie_word_embeddings:  # some tied checkpoints also store a copy of the head
        ignored = ignored | {"lm_head.weight"}
    ignored = ignored | mtp_names(arch, source)  # loaded apart (`mtp_state_dict`), if at all
    unused = source.names() - take.used - ignored
    if unused:
        raise ModelLoadError(
            f"the checkpoint has tensors this implementation does not use "
            f"(unsupported feature?): {', '.join(sorted(unused)[:8])}"
        )
    return {name: tensor for name, tensor in state.items() if tensor is not _SERVED}


def mtp_names(arch: ModelArch, source: TensorSource) -> frozenset[str]:
    """The source's tensors of its multi-token-prediction layers (`ModelArch.num_mtp_layers`)."""
    prefixes = tuple(f"layers.{arch.num_layers + j}." for j in range(arch.num_mtp_layers))
    if not prefixes:
        return frozenset()
    return frozenset(name for name in source.names() if name.startswith(prefixes))


MTP_TENSORS = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
    "embed_tokens.weight": "embed_tokens.weight",
    "head.weight": "shared_head.head.weight",
}
"""An MTP layer's own tensors beside its decoder layer's (`MTPHead` names: DeepSeek-V3's)."""


def mtp_state_dict(
    arch: ModelArch, source: TensorSource, dtype: torch.dtype, device: torch.device
) -> StateDict:
    """The first multi-token-prediction layer's state dict (`model/mtp.py`'s `MTPHead`): its
    decoder layer under `block.`, its norms, projection, embedding and head; every tensor of
    that layer must be used."""
    if not arch.num_mtp_layers:
        raise ModelLoadError("the checkpoint has no multi-token-prediction layers")
    index = arch.num_layers
    take = _Taker(source, dtype, device)
    prefix = f"layers.{index}."
    state = {
        "block." + name.removeprefix(prefix): tensor
        for name, tensor in _layer_state(arch, take, index).items()
    }
    state.update({ours: take(prefix + theirs) for ours, theirs in MTP_TENSORS.items()})
    unused = {n for n in source.names() if n.startswith(prefix)} - take.used
    if unused:
        raise ModelLoadError(
            f"the multi-token-prediction layer has tensors this implementation does not use: "
            f"{', '.join(sorted(unused)[:8])}"
        )
    return state
