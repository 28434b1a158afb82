"""A model's RoPE table: plain, or YaRN-scaled (DeepSeek-V3 and others that extend their
context): per pair of dimensions, frequencies interpolated by `factor` below a band of
wavelengths, kept above it, blended linearly inside it; cos and sin scaled by an attention
factor. As transformers computes it (`_compute_yarn_parameters`), float32 frequencies."""

from __future__ import annotations

import math

import torch

from deepinfer.kernels.elementwise.rotary_torch import rotary_cos_sin
from deepinfer.model.arch import ModelArch, YarnRope


def rope_table(arch: ModelArch, device: torch.device) -> torch.Tensor:  # [P, rotary_dim]
    dim, base, yarn = arch.rotary_dim, arch.rope_theta, arch.rope_yarn
    if yarn is None:
        return rotary_cos_sin(dim, arch.max_position_embeddings, base, device)
    return rotary_cos_sin(
        dim, arch.max_position_embeddings, base, device, yarn_inv_freq(dim, base, yarn),
        yarn.attention_factor,
    )  # fmt: skip


def yarn_inv_freq(dim: int, base: float, yarn: YarnRope) -> torch.Tensor:
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (yarn.factor * pos_freqs)
    low, high = (
        _correction_dim(rotations, dim, base, yarn.original_max_positions)
        for rotations in (yarn.beta_fast, yarn.beta_slow)
    )
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of each pair's frequency left unscaled
    return interpolation * (1 - keep) + extrapolation * keep


def _correction_dim(rotations: float, dim: int, base: float, max_positions: int) -> float:
    """The dimension whose wavelength fits `rotations` times in `max_positions`."""
    return (dim * math.log(max_positions / (rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
