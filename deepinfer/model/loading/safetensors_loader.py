"""Read a Hugging Face model directory: config.json and *.safetensors, HF tensor names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from deepinfer.errors import ModelLoadError
from deepinfer.model.arch import MLAArch, ModelArch, MoEArch, YarnRope
from deepinfer.model.registry import check_architecture
from deepinfer.model.rope import yarn_mscale

# Buffers some older checkpoints save; recomputed by the model.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_config(directory: Path) -> dict[str, Any]:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(
            f"{directory} is not a Hugging Face model directory (no config.json); pass a .gguf "
            "file or a directory with config.json and *.safetensors"
        )
    try:
        config: dict[str, Any] = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {config_path}: {exc}") from exc
    return config


def _rope(config: dict[str, Any]) -> float:
    """rope_theta; refuses RoPE scaling but YaRN's (older configs: rope_scaling; newer:
    rope_parameters)."""
    rope_type = _rope_scaling(config).get("rope_type", _rope_scaling(config).get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ModelLoadError(f"RoPE scaling {rope_type!r} is not supported")
    return float(config.get("rope_theta") or _rope_params(config).get("rope_theta") or 10000.0)


def _rope_scaling(config: dict[str, Any]) -> dict[str, Any]:
    scaling: dict[str, Any] = config.get("rope_scaling") or _rope_params(config)
    return scaling


def _yarn(config: dict[str, Any]) -> YarnRope | None:
    """YaRN's parameters, where the config scales RoPE so (as transformers reads them)."""
    p = _rope_scaling(config)
    if p.get("rope_type", p.get("type")) != "yarn":
        return None
    original = int(p["original_max_position_embeddings"])
    factor = float(p.get("factor") or int(config["max_position_embeddings"]) / original)
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    attention_factor = p.get("attention_factor")
    if attention_factor is None and mscale and mscale_all_dim:
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    elif attention_factor is None:
        attention_factor = yarn_mscale(factor)
    return YarnRope(
        factor=factor,
        original_max_positions=original,
        beta_fast=float(p.get("beta_fast") or 32),
        beta_slow=float(p.get("beta_slow") or 1),
        attention_factor=float(attention_factor),
        truncate=bool(p.get("truncate", True)),
    )


_MODEL_TYPES = {"gemma3_text": "gemma3"}
"""Hugging Face model types served under another registry key."""
_QKV_BIAS = ("qwen2", "qwen2_moe")
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "dots1", "deepseek_v3")


def _gemma3(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Gemma 3's windows, windowed layers' RoPE base and query scale (transformers 4 and 5
    spellings); refuses the options this implementation does not have."""
    refused = [
        key
        for key in (
            "final_logit_softcapping",
            "attn_logit_softcapping",
            "use_bidirectional_attention",
        )
        if config.get(key)
    ]
    if refused:
        raise ModelLoadError(f"unsupported gemma3 config options: {', '.join(refused)}")
    types = config.get("layer_types")
    if types is None:
        every = int(
            config.get("sliding_window_pattern") or config.get("_sliding_window_pattern", 6)
        )
        types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    window = int(config["sliding_window"])
    local = (config.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"RoPE scaling {local['rope_type']!r} is not supported")
    return {
        "layer_windows": tuple(0 if t == "full_attention" else window for t in types),
        "rope_local_theta": float(
            local.get("rope_theta") or config.get("rope_local_base_freq") or 10000.0
        ),
        "query_scale": float(config.get("query_pre_attn_scalar") or config["head_dim"]) ** -0.5,
    }


_MIXTRAL_NAMES = (
    (".block_sparse_moe.experts.", ".mlp.experts."),
    (".block_sparse_moe.gate.", ".mlp.gate."),
)
_MIXTRAL_EXPERT = {".w1.weight": ".gate_proj.weight", ".w3.weight": ".up_proj.weight",
                   ".w2.weight": ".down_proj.weight"}  # fmt: skip


def canonical_name(name: str, model_type: str) -> str:
    """A checkpoint tensor's canonical name (Mixtral's experts and router, DeepSeek-style shared
    experts, under Qwen-MoE's)."""
    if ".mlp.shared_experts." in name:
        return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
    if model_type == "mixtral" and ".block_sparse_moe." in name:
        for theirs, ours in _MIXTRAL_NAMES:
            name = name.replace(theirs, ours)
        for theirs, ours in _MIXTRAL_EXPERT.items():
            if ".mlp.experts." in name and name.endswith(theirs):
                name = name.removesuffix(theirs) + ours
    return name


def _moe(config: dict[str, Any], name: str, num_layers: int) -> MoEArch:
    """The experts of a Mixtral, Qwen2-MoE, Qwen3-MoE or dots.llm1 config."""
    if name in ("dots1", "deepseek_v3"):
        return _deepseek_moe(config, num_layers)
    # Qwen's own configs say num_experts; transformers 5 writes num_local_experts for Qwen3-MoE
    num_experts = int(config.get("num_experts") or config["num_local_experts"])
    if name == "mixtral":
        return MoEArch(
            num_experts=num_experts,
            top_k=int(config["num_experts_per_tok"]),
            expert_intermediate_size=int(config["intermediate_size"]),
        )
    step = int(config.get("decoder_sparse_step") or 1)
    only_dense = {int(i) for i in config.get("mlp_only_layers") or ()}
    dense = tuple(i for i in range(num_layers) if i in only_dense or (i + 1) % step)
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    return MoEArch(
        num_experts=num_experts,
        top_k=int(config["num_experts_per_tok"]),
        expert_intermediate_size=int(config["moe_intermediate_size"]),
        renormalize=bool(config.get("norm_topk_prob", False)),
        shared_intermediate_size=shared,
        shared_gate=shared > 0,
        dense_layers=dense,
    )


def _deepseek_moe(config: dict[str, Any], num_layers: int) -> MoEArch:
    """DeepSeek-V3-style experts (dots.llm1): sigmoid scores with a choosing bias, grouped top
    k, ungated shared experts, the first `first_k_dense_replace` layers dense."""
    width = int(config["moe_intermediate_size"])
    dense = min(int(config.get("first_k_dense_replace") or 0), num_layers)
    return MoEArch(
        num_experts=int(config["n_routed_experts"]),
        top_k=int(config["num_experts_per_tok"]),
        expert_intermediate_size=width,
        routing="sigmoid_topk",
        renormalize=bool(config.get("norm_topk_prob", False)),
        routed_scaling=float(config.get("routed_scaling_factor") or 1.0),
        shared_intermediate_size=width * int(config.get("n_shared_experts") or 0),
        dense_layers=tuple(range(dense)),
        score_bias=True,
        num_groups=int(config.get("n_group") or 1),
        topk_groups=int(config.get("topk_group") or 1),
    )


def _mla(config: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's latent attention: as many KV heads as query heads, a head's key its
    non-rotary and rotary parts (wide as the cache's head)."""
    mla = MLAArch(
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        q_lora_rank=int(config.get("q_lora_rank") or 0),
        interleaved_rope=bool(config.get("rope_interleave", True)),
    )
    head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    scale = head_dim**-0.5
    yarn, mscale_all_dim = _yarn(config), _rope_scaling(config).get("mscale_all_dim")
    if yarn is not None and mscale_all_dim:  # DeepSeek's softmax scale follows YaRN's too
        scale *= yarn_mscale(yarn.factor, mscale_all_dim) ** 2
    return {
        "mla": mla,
        "head_dim": head_dim,
        "num_kv_heads": int(config["num_attention_heads"]),
        "query_scale": scale,
    }


def _attention(config: dict[str, Any], name: str) -> dict[str, Any]:
    """Heads' shapes (and latent attention's, for DeepSeek-V3)."""
    if name == "deepseek_v3":
        return _mla(config)
    num_heads = int(config["num_attention_heads"])
    return {
        "num_kv_heads": int(config.get("num_key_value_heads") or num_heads),
        "head_dim": int(config.get("head_dim") or int(config["hidden_size"]) // num_heads),
    }


def _rope_params(config: dict[str, Any]) -> dict[str, Any]:
    """The full-attention layers' RoPE parameters (transformers 5 nests them per layer type)."""
    params = config.get("rope_parameters") or {}
    return params.get("full_attention", params)


def hf_arch(config: dict[str, Any], has_lm_head: bool) -> ModelArch:
    """The architecture of a Hugging Face config (llama, qwen2, qwen3, gemma3_text, mixtral,
    qwen2_moe, qwen3_moe, dots1, deepseek_v3)."""
    model_type = str(config.get("model_type", "<missing model_type>"))
    name = _MODEL_TYPES.get(model_type, model_type)
    check_architecture(name)
    unsupported = [key for key in ("mlp_bias", "use_sliding_window") if config.get(key)]
    if name == "mixtral" and config.get("sliding_window"):
        unsupported.append("sliding_window")
    if "sliding_attention" in (config.get("layer_types") or ()) and name != "gemma3":
        unsupported.append("sliding_attention layers")
    if config.get("attention_bias") and name not in _QKV_BIAS:
        unsupported.append("attention_bias (output projection bias)")
    if unsupported:
        raise ModelLoadError(f"unsupported {name} config options: {', '.join(unsupported)}")
    try:
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        num_layers = int(config["num_hidden_layers"])
        return ModelArch(
            architecture=name,
            num_layers=num_layers,
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_heads=num_heads,
            vocab_size=int(config["vocab_size"]),
            rope_theta=_rope(config),
            rope_yarn=_yarn(config),
            rms_norm_eps=float(config["rms_norm_eps"]),
            max_position_embeddings=int(config["max_position_embeddings"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings")) or not has_lm_head,
            qkv_bias=name in _QKV_BIAS,
            qk_norm=name in ("qwen3", "qwen3_moe", "gemma3", "dots1"),
            moe=_moe(config, name, num_layers) if name in _MOE else None,
            num_mtp_layers=int(config.get("num_nextn_predict_layers") or 0)
            if name == "deepseek_v3"
            else 0,
            **(_gemma3(config, num_layers) if name == "gemma3" else {}),
            **_attention(config, name),
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks the key {exc.args[0]!r}") from exc


class SafetensorsSource:
    """`TensorSource` over the *.safetensors files of a directory (memory-mapped by safetensors).
    With `norm_offset`, every norm weight w loads as 1 + w (Gemma stores the offset from 1)."""

    def __init__(self, directory: Path, norm_offset: bool = False, model_type: str = "") -> None:
        self.norm_offset = norm_offset
        self.files = sorted(directory.glob("*.safetensors"))
        if not self.files:
            raise ModelLoadError(f"{directory} has config.json but no *.safetensors files")
        self._handles: dict[str, Any] = {}
        self._file_of: dict[str, tuple[Any, str]] = {}
        for path in self.files:
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from exc
            self._handles[path.name] = handle
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                self._file_of[canonical_name(key.removeprefix("model."), model_type)] = (
                    handle,
                    key,
                )

    def names(self) -> set[str]:
        return {n for n in self._file_of if not n.endswith(IGNORED_SUFFIXES)}

    def load(self, name: str) -> torch.Tensor:
        handle, key = self._file_of[name]
        try:
            tensor: torch.Tensor = handle.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read tensor {key!r}: {exc}") from exc
        if self.norm_offset and name.endswith("norm.weight"):
            return 1.0 + tensor.float()
        return tensor


def open_safetensors_dir(directory: Path) -> tuple[ModelArch, SafetensorsSource]:
    config = _read_config(directory)
    model_type = str(config.get("model_type"))
    gemma = _MODEL_TYPES.get(model_type) == "gemma3"
    source = SafetensorsSource(directory, norm_offset=gemma, model_type=model_type)
    arch = hf_arch(config, has_lm_head="lm_head.weight" in source.names())
    return arch, source
