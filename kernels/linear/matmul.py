"""Matmul with a fixed reduction order (no split-K): the base of the batch-invariant mode.

Every output element is reduced over K in the same order (BLOCK_K tiles, ascending) whatever M,
N or the rest of the batch are: tile sizes are constants, never autotuned per shape.
"""

from __future__ import annotations

import torch

from ..dispatch import cdiv, check, check_tensor, dot_precision, output_buffer, require_backend
from ..triton_common import dot, jit, tl

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_M = 128
BLOCK_N = 128
GROUP_M = 8


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N]."""
    return a @ b


@jit
def _matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program per [BLOCK_M, BLOCK_N] output tile, grouped along M for L2 reuse."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = dot(a, b, acc, UPCAST, PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def matmul(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of `matmul_reference`: a [M, K] @ b [K, N] -> [M, N] in a's dtype.

    Any strides (b may be a transposed weight view); fp32 accumulation; fp32 inputs use exact
    (non-tf32) dots. `out`, if given, receives the result (any strides).
    """
    device = a.device
    check_tensor("a", a, 2, _FLOAT_DTYPES, device, last_dim_contiguous=False)
    check_tensor("b", b, 2, (a.dtype,), device, last_dim_contiguous=False)
    check(a.shape[1] == b.shape[0], f"cannot multiply {tuple(a.shape)} by {tuple(b.shape)}")
    require_backend(device, _matmul_kernel)
    (m, k), n = a.shape, b.shape[1]
    c = output_buffer("out", out, (m, n), a.dtype, device, last_dim_contiguous=False)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()
    block_k = 32 if a.dtype == torch.float32 else 64
    grid = (cdiv(m, BLOCK_M) * cdiv(n, BLOCK_N),)
    _matmul_kernel[grid](
        a,
        b,
        c,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=block_k,
        GROUP_M=GROUP_M,
        UPCAST=device.type == "cpu",
        PRECISION=dot_precision(a.dtype),
        num_warps=8,
        num_stages=3,
    )
    return c
