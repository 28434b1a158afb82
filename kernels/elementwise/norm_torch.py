"""Plain-torch RMSNorm and residual-add + RMSNorm: the CPU path and the tests' oracle
(re-exported by `norm`, next to their Triton launchers)."""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True).add_(eps))
    if normed.dtype == x.dtype and weight.dtype == x.dtype:  # fp32 (the CPU path): no copies
        return normed.mul_(weight)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor,  # [T, D]
    residual: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [D]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed
