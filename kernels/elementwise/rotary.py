"""Rotary position embedding (rotate-half layout), applied in place to q and k: Triton launcher.

The cos/sin table and the torch reference live in `rotary_torch` (the CPU path imports that
module, never this one) and are re-exported here next to the launcher.
"""

from __future__ import annotations

import torch

from ..dispatch import check, check_tensor, next_power_of_2, require_backend
from ..triton_common import jit, tl
from .rotary_torch import apply_rotary_reference, rotary_cos_sin

__all__ = ["apply_rotary", "apply_rotary_reference", "rotary_cos_sin"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@jit
def _rotary_kernel(
    x_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_xt,
    stride_xh,
    stride_cs,
    num_heads,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program per token: rotates all its heads in place, in fp32."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < half
    table_row = cos_sin_ptr + position * stride_cs + dims
    cos = tl.load(table_row, mask=dim_mask, other=0.0)[None, :]
    sin = tl.load(table_row + half, mask=dim_mask, other=0.0)[None, :]
    heads = tl.arange(0, BLOCK_H)[:, None]
    mask = (heads < num_heads) & dim_mask[None, :]
    first = x_ptr + token * stride_xt + heads * stride_xh + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(first + half, (b * cos + a * sin).to(x1.dtype), mask=mask)


def _rotate_in_place(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens == 0 or num_heads == 0:
        return
    _rotary_kernel[(num_tokens,)](
        x,
        positions,
        cos_sin,
        x.stride(0),
        x.stride(1),
        cos_sin.stride(0),
        num_heads,
        head_dim // 2,
        BLOCK_H=next_power_of_2(num_heads),
        BLOCK_HALF=next_power_of_2(head_dim // 2),
    )


def apply_rotary(
    q: torch.Tensor,  # [T, H, D], any token/head strides (e.g. a view of a fused QKV output)
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int32/int64, each < P (unchecked: a device sync)
    cos_sin: torch.Tensor,  # [P, D] fp32, from `rotary_cos_sin`
) -> None:
    """Triton version of `apply_rotary_reference`: rotates q and k in place."""
    device = q.device
    check_tensor("q", q, 3, _FLOAT_DTYPES, device)
    check_tensor("k", k, 3, (q.dtype,), device)
    head_dim = q.shape[2]
    check(head_dim % 2 == 0, f"head_dim must be even, got {head_dim}")
    check(k.shape[0] == q.shape[0] and k.shape[2] == head_dim, "k must be [T, Hkv, D] like q")
    check_tensor("positions", positions, 1, (torch.int32, torch.int64), device, False)
    check(positions.shape[0] == q.shape[0], "positions must have one entry per token")
    check_tensor("cos_sin", cos_sin, 2, (torch.float32,), device)
    check(cos_sin.shape[1] == head_dim, f"cos_sin must be [P, {head_dim}]")
    require_backend(device, _rotary_kernel)
    _rotate_in_place(q, positions, cos_sin)
    _rotate_in_place(k, positions, cos_sin)
