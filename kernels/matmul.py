"""Matmul with a fixed reduction order (no split-K): the base of the batch-invariant mode."""

from __future__ import annotations

import torch


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N]."""
    return a @ b
