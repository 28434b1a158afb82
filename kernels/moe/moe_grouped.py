"""Triton grouped-expert matmul: every expert's rows of a step in one launch.

The step's (token, expert) pairs are laid out by expert, each expert's run padded to whole
blocks of `BLOCK_M` rows (`align_pairs`); a program multiplies one block of one expert's rows by
one tile of that expert's weight, reading the rows where they are (a pair's token row for the
first matmul, its own row for the second) and writing each pair's own output row. Tile sizes
are constants, so a row's sums do not depend on the rest of the step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..dispatch import cdiv, check, check_tensor, dot_precision, require_backend
from ..triton_common import dot, jit, tl

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 32
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@jit
def _grouped_matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    rows_ptr,
    block_expert_ptr,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    ROWS_PER_X: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[p] = x[p // ROWS_PER_X] @ w[e]^T for the pairs p of one block (-1: padding)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs >= 0
    x_rows = tl.where(valid, pairs // ROWS_PER_X, 0)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(x_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = dot(a, b, acc, UPCAST, PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    out_ptrs = out_ptr + pairs[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(
        out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N)
    )


def align_pairs(
    experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, block_expert): the pairs (flat indices into `experts` [T, k]) by expert, each
    expert's run padded with -1 to whole blocks of `block_m`; the expert of each block."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    dest = starts[sorted_experts] + torch.arange(flat.numel(), device=flat.device)
    dest -= first[sorted_experts]
    rows = torch.full((int(padded.sum()),), -1, dtype=torch.int64, device=flat.device)
    rows[dest] = order
    block_expert = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device), padded // block_m
    )
    return rows, block_expert


def grouped_matmul(
    x: torch.Tensor,  # [R, K]
    w: torch.Tensor,  # [E, N, K]
    rows: torch.Tensor,
    block_expert: torch.Tensor,
    num_pairs: int,
    rows_per_x: int,
) -> torch.Tensor:  # [num_pairs, N]
    """out[p] = x[p // rows_per_x] @ w[expert of p]^T for every pair p listed in `rows`."""
    device = x.device
    check_tensor("x", x, 2, _FLOAT_DTYPES, device, last_dim_contiguous=False)
    check_tensor("w", w, 3, (x.dtype,), device, last_dim_contiguous=False)
    check(w.shape[2] == x.shape[1], f"cannot multiply {tuple(x.shape)} by {tuple(w.shape)}")
    require_backend(device, _grouped_matmul_kernel)
    out = torch.empty(num_pairs, w.shape[1], dtype=x.dtype, device=device)
    if block_expert.numel() == 0 or out.numel() == 0:
        return out
    grid = (block_expert.numel(), cdiv(w.shape[1], BLOCK_N))
    _grouped_matmul_kernel[grid](
        x, w, out, rows, block_expert, w.shape[1], w.shape[2],
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        ROWS_PER_X=rows_per_x, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        UPCAST=device.type == "cpu", PRECISION=dot_precision(x.dtype),
    )  # fmt: skip
    return out


def triton_grouped_experts(
    h: torch.Tensor,  # [T, D]
    experts: torch.Tensor,  # [T, k]
    gates: torch.Tensor,  # [T, k] float32
    w_gate_up: torch.Tensor,  # [E, 2I, D]
    w_down: torch.Tensor,  # [E, D, I]
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:  # [T, D]
    """`moe_torch.grouped_experts` with float experts, each matmul one launch for every expert;
    a token's k gated outputs are summed in the order of its pairs."""
    num_tokens, top_k = experts.shape
    rows, block_expert = align_pairs(experts, w_gate_up.shape[0])
    pairs = num_tokens * top_k
    gate_up = grouped_matmul(h, w_gate_up, rows, block_expert, pairs, rows_per_x=top_k)
    down = grouped_matmul(activation(gate_up), w_down, rows, block_expert, pairs, rows_per_x=1)
    weighted = down.view(num_tokens, top_k, -1) * gates.to(down.dtype)[..., None]
    return weighted.sum(dim=1)
