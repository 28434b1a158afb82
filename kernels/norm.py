"""RMSNorm, and residual-add fused with RMSNorm."""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor,  # [T, D]
    residual: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [D]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed
