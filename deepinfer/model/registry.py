"""Architecture name -> model class: a plain dict with lazy imports."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from deepinfer.errors import ModelLoadError

if TYPE_CHECKING:
    from torch import nn

MODEL_REGISTRY: dict[str, str] = {
    # One Llama-family implementation; ModelArch flags carry the differences
    # (Qwen2: QKV bias; Qwen3: per-head q/k RMSNorm).
    "llama": "deepinfer.model.llama:LlamaForCausalLM",
    "qwen2": "deepinfer.model.llama:LlamaForCausalLM",
    "qwen3": "deepinfer.model.llama:LlamaForCausalLM",
    # Sliding-window layers, four norms a layer, scaled embeddings, gelu-tanh FFN.
    "gemma3": "deepinfer.model.gemma3:Gemma3ForCausalLM",
    # Mixture of Experts: a router and experts in place of the FFN of the sparse layers.
    "mixtral": "deepinfer.model.experts.moe:MoEForCausalLM",
    "qwen2_moe": "deepinfer.model.experts.moe:MoEForCausalLM",
    "qwen3_moe": "deepinfer.model.experts.moe:MoEForCausalLM",
    "dots1": "deepinfer.model.experts.moe:MoEForCausalLM",
    # DeepSeek-V3's latent attention and experts
    "deepseek_v3": "deepinfer.model.experts.moe:MoEForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def check_architecture(architecture: str) -> None:
    """Raise `ModelLoadError` naming the supported architectures if `architecture` is not one."""
    if architecture not in MODEL_REGISTRY:
        raise ModelLoadError(
            f"unsupported model architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())}"
        )


def get_model_class(architecture: str) -> type[nn.Module]:
    """The model class serving `architecture` (imported on first use)."""
    check_architecture(architecture)
    module_name, _, class_name = MODEL_REGISTRY[architecture].partition(":")
    model_class: type[nn.Module] = getattr(importlib.import_module(module_name), class_name)
    return model_class
