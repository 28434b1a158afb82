"""Multi-head latent attention (DeepSeek-V3 and the models built on it), served through the
paged caches and attention kernels every other layer uses.

A token's keys and values come from a compressed latent: `kv_a_proj` gives `kv_lora_rank`
values (RMS-normed) and one RoPE key of `qk_rope_head_dim` shared by every head; `kv_b_proj`
expands the latent into each head's non-rotary key part and its value. Queries come from their
own latent (`q_a_proj`, a norm, `q_b_proj`) or a plain projection. A head's key is its
non-rotary part then the shared rotated part (`ModelArch.head_dim` wide); its value is
`v_head_dim` wide, stored zero-padded to the key's width so the caches keep one head size (the
padding's products are zeros, and are dropped before the output projection).

The cache holds the expanded keys and values: the KV bytes of a grouped-query model with as
many KV heads as query heads. Caching the latent instead (kv_lora_rank + qk_rope_head_dim
values a token, and attention computed against it with `kv_b_proj` absorbed into the query and
output) would take several times fewer bytes; it needs attention kernels of its own.

DeepSeek checkpoints lay each head's rotary dimensions out in interleaved pairs; the loader
permutes those rows of `q_b_proj` (or `q_proj`) and `kv_a_proj` into halves
(`weights.deinterleave_rows`), so the rotate-half RoPE of every other model applies, with the same
scores.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.model.arch import ModelArch
from deepinfer.model.llama_layers import Linear, RMSNorm
from deepinfer.model.step_context import StepContext


class MLAAttention(nn.Module):
    def __init__(self, arch: ModelArch, layer: int) -> None:
        super().__init__()
        assert arch.mla is not None
        m, d, h = arch.mla, arch.hidden_size, arch.num_heads
        self.arch, self.mla = arch, m
        self.window = None
        if m.q_lora_rank:
            self.q_a_proj = Linear(d, m.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(m.q_lora_rank)
            self.q_b_proj = Linear(m.q_lora_rank, h * arch.head_dim, bias=False)
        else:
            self.q_proj = Linear(d, h * arch.head_dim, bias=False)
        self.kv_a_proj = Linear(d, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank)
        self.kv_b_proj = Linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), False)
        self.o_proj = Linear(h * m.v_head_dim, d, bias=False)
        self.scale = arch.attention_scale

    def _queries(self, h: torch.Tensor, step: StepContext) -> torch.Tensor:  # [T, H, D]
        a, ops = self.arch, step.ops
        if self.mla.q_lora_rank:
            latent = ops.rms_norm(self.q_a_proj(h), self.q_a_norm.weight, a.rms_norm_eps)
            q = self.q_b_proj(latent)
        else:
            q = self.q_proj(h)
        return q.view(h.shape[0], a.num_heads, a.head_dim)

    def project(
        self, h: torch.Tensor, step: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [T, H, D] each
        """Every head's query, key and (zero-padded) value, rotated."""
        a, m, ops = self.arch, self.mla, step.ops
        t, heads, nope = h.shape[0], a.num_heads, m.qk_nope_head_dim
        q = self._queries(h, step)
        latent, k_rope = self.kv_a_proj(h).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = ops.rms_norm(latent.contiguous(), self.kv_a_norm.weight, a.rms_norm_eps)
        kv = self.kv_b_proj(latent).view(t, heads, nope + m.v_head_dim)
        q_rope = q[..., nope:].contiguous()  # [T, H, R]
        k_rope = k_rope.contiguous().view(t, 1, m.qk_rope_head_dim)  # [T, 1, R]: every head's
        ops.apply_rotary(q_rope, k_rope, step.batch.positions, step.cos_sin)
        q = torch.cat([q[..., :nope], q_rope], dim=-1)
        k = torch.cat([kv[..., :nope], k_rope.expand(t, heads, -1)], dim=-1)
        v = h.new_zeros(t, heads, a.head_dim)
        v[..., : m.v_head_dim] = kv[..., nope:]
        return q, k, v

    def output(self, out: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [T, hidden]
        t, heads, width = out.shape[0], self.arch.num_heads, self.mla.v_head_dim
        return self.o_proj(out[..., :width].reshape(t, heads * width))
