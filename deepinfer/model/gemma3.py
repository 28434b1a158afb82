"""Gemma 3: the Llama-family decoder with Gemma's differences.

- Five of every six layers attend a sliding window (`ModelArch.layer_windows`), with a RoPE base
  of their own (`rope_local_theta`); q and k are RMS-normalized per head (`qk_norm`).
- Each block's input and output are normalized (four norms a layer): the attention output and
  the FFN output pass through a norm before they join the residual stream.
- The FFN is gelu-tanh gated; token embeddings are scaled by sqrt(hidden); the head is tied.

Norm weights are the factors they multiply by (Gemma's own checkpoints store w for 1 + w: the
safetensors loader adds the 1, llama.cpp's converter already did), so every norm is the same
`x * rsqrt(mean(x^2) + eps) * w` as Llama's.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from deepinfer.kernels.layers.llama_layers_cpu import Activation, LayerWeights
from deepinfer.model.arch import ModelArch
from deepinfer.model.attention import AttentionBackend
from deepinfer.model.llama import LlamaForCausalLM
from deepinfer.model.llama_layers import (
    LlamaDecoderLayer,
    LlamaMLP,
    RMSNorm,
    native_layer_weights,
)
from deepinfer.model.step_context import StepContext


class Gemma3MLP(LlamaMLP):
    def forward(self, h: torch.Tensor, ops: AttentionBackend) -> torch.Tensor:
        return self.down_proj(ops.gelu_tanh_mul(self.gate_up_proj(h)))  # [T, 2I] -> [T, D]


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with norms of the attention and FFN outputs and a gelu_tanh FFN."""

    def __init__(self, arch: ModelArch, layer: int) -> None:
        super().__init__(arch, layer)
        self.pre_ffn_norm = RMSNorm(arch.hidden_size)
        self.mlp = Gemma3MLP(arch)
        self.post_ffn_norm = RMSNorm(arch.hidden_size)

    def attention_output(
        self, out: torch.Tensor, residual: torch.Tensor, step: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's normed FFN output, the residual stream before it is added)."""
        ops = step.ops
        h = ops.rms_norm(self.self_attn.output(out), self.post_attention_norm.weight, self.eps)
        h, residual = ops.fused_add_rms_norm(h, residual, self.pre_ffn_norm.weight, self.eps)
        h = ops.rms_norm(self.mlp(h, ops), self.post_ffn_norm.weight, self.eps)
        return h, residual

    def native_weights(
        self, kv_cache: tuple[torch.Tensor, torch.Tensor], cos_sin: torch.Tensor
    ) -> LayerWeights:
        """This layer as the native stack computes it: Llama's, with the gelu_tanh gate and the
        norms of the attention and FFN outputs."""
        llama = native_layer_weights(
            self.self_attn, self.mlp, self.input_norm, self.pre_ffn_norm, kv_cache, cos_sin
        )
        return dataclasses.replace(
            llama,
            activation=Activation.GELU_TANH,
            attn_out_norm=self.post_attention_norm.weight.data,
            mlp_out_norm=self.post_ffn_norm.weight.data,
        )


class Gemma3ForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM`'s interface and paged caches, with Gemma 3's layers and embedding."""

    decoder_layer = Gemma3DecoderLayer

    def __init__(
        self, arch: ModelArch, device: torch.device, backend: AttentionBackend | None = None
    ) -> None:
        super().__init__(arch, device, backend)
        self.embed_scale = torch.tensor(math.sqrt(arch.hidden_size), dtype=torch.float32).item()
        """sqrt(hidden) rounded to float32, as the reference multiplies by it."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.embed_tokens(input_ids) * self.embed_scale
