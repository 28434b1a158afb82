"""RMSNorm, and residual-add fused with RMSNorm: the Triton launchers.

The torch references live in `norm_torch` (the CPU path imports that module, never this one)
and are re-exported here next to their launchers.
"""

from __future__ import annotations

import torch

from ..dispatch import (
    KernelUnsupportedError,
    check,
    check_tensor,
    next_power_of_2,
    output_buffer,
    require_backend,
)
from ..triton_common import jit, tl
from .norm_torch import fused_add_rms_norm_reference, rms_norm_reference

__all__ = [
    "fused_add_rms_norm",
    "fused_add_rms_norm_reference",
    "rms_norm",
    "rms_norm_reference",
]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_BLOCK_D = 16384


@jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    stride_x,
    stride_r,
    stride_out,
    stride_sum,
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per row. Rounds exactly where the reference does: the sum to x's dtype, the
    normalized row to x's dtype, then the product with the weight to the output dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(summed_ptr + row * stride_sum + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / dim
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask
    )


def _check_norm_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_tensor("x", x, 2, _FLOAT_DTYPES, x.device)
    check_tensor("weight", weight, 1, _FLOAT_DTYPES, x.device)
    check(weight.shape[0] == x.shape[1], f"weight has {weight.shape[0]} rows, x has {x.shape[1]}")
    if next_power_of_2(x.shape[1]) > _MAX_BLOCK_D:
        raise KernelUnsupportedError(f"rms_norm covers rows of at most {_MAX_BLOCK_D} elements")


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    summed_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = tuple(x.shape)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = output_buffer("out", out, shape, out_dtype, x.device)
    summed = out
    if residual is not None:
        summed = output_buffer("summed_out", summed_out, shape, x.dtype, x.device)
    num_rows, dim = x.shape
    if num_rows > 0:
        _rms_norm_kernel[(num_rows,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            summed,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            summed.stride(0),
            dim,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            BLOCK_D=next_power_of_2(dim),
            num_warps=min(16, max(1, next_power_of_2(dim) // 512)),
        )
    return out, summed


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton version of `rms_norm_reference` for x [T, D], weight [D]; the result has the
    promoted dtype of x and weight, like the reference. x [T, H, D] (q/k norms: one row per
    head) is normalized row by row as [T * H, D] (without `out`)."""
    if x.dim() == 3 and out is None:
        rows = x.reshape(-1, x.shape[-1])
        return rms_norm(rows, weight, eps).view(*x.shape[:-1], -1)
    _check_norm_inputs(x, weight)
    require_backend(x.device, _rms_norm_kernel)
    return _launch(x, None, weight, eps, out, None)[0]


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, D]
    residual: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [D]
    eps: float,
    *,
    out: torch.Tensor | None = None,
    summed_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `fused_add_rms_norm_reference`: (rms_norm(x + residual), x + residual).

    `summed_out` may be `residual` itself (each row is read before it is written)."""
    _check_norm_inputs(x, weight)
    check_tensor("residual", residual, 2, (x.dtype,), x.device)
    check(residual.shape == x.shape, "residual must have the shape of x")
    require_backend(x.device, _rms_norm_kernel)
    return _launch(x, residual, weight, eps, out, summed_out)
