"""Rotary position embedding (rotate-half layout), applied in place to q and k."""

from __future__ import annotations

import torch

from .dispatch import check, check_tensor, jit, next_power_of_2, require_backend, tl

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
