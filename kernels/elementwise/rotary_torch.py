"""Plain-torch rotary position embedding (rotate-half layout) and its cos/sin table: the CPU path
and the tests' oracle (re-exported by `rotary`, next to its Triton launcher)."""

from __future__ import annotations

import torch


def rotary_cos_sin(
    head_dim: int,
    max_positions: int,
    base: float,
    device: torch.device | str = "cpu",
    inv_freq: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:  # [P, D]: cos in the first half, sin in the second
    """The table RoPE reads: base ** (-2i / D) per pair (or `inv_freq`, a scaled RoPE's), cos
    and sin of every position's angles, times `scale` (YaRN's attention factor)."""
    if inv_freq is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :].double()
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return (table * scale if scale != 1.0 else table).float().to(device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _rotate_torch_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`_rotate` without temporaries of x's size, for x already in the table's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    x1_sin = x1 * sin
    x1.mul_(cos).addcmul_(x2, sin, value=-1.0)  # x1 cos - x2 sin
    x2.mul_(cos).add_(x1_sin)  # x2 cos + x1 sin


def apply_rotary_reference(
    q: torch.Tensor,  # [T, H, D], any token/head strides
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin: torch.Tensor,  # [P, D]
) -> None:
    half = q.shape[-1] // 2
    table = cos_sin[positions]  # [T, D]
    cos, sin = table[:, None, :half], table[:, None, half:]
    for x in (q, k):
        if x.dtype == table.dtype:  # fp32 (the CPU path): in place, a few ops per tensor
            _rotate_torch_in_place(x, cos, sin)
        else:  # lower precision: rotate in fp32, round once
            x.copy_(_rotate(x, cos, sin))
