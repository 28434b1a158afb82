"""Rotary position embedding (rotate-half layout), applied in place to q and k."""

from __future__ import annotations

import torch


def rotary_cos_sin(
    head_dim: int, max_positions: int, base: float, device: torch.device | str = "cpu"
) -> torch.Tensor:  # [P, D]: cos in the first half, sin in the second
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float().to(device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def apply_rotary_reference(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin: torch.Tensor,  # [P, D]
) -> None:
    half = q.shape[-1] // 2
    table = cos_sin[positions]  # [T, D]
    cos, sin = table[:, None, :half], table[:, None, half:]
    q.copy_(_rotate(q, cos, sin))
    k.copy_(_rotate(k, cos, sin))
