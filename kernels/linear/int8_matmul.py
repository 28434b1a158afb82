"""Linear layers over GGUF block-quantized weights with int8 activations (integer dot products).

llama.cpp's CPU arithmetic: each row of x is quantized to int8 in blocks of 32 (scale
max|x| / 127, round half to even), and each 32-long piece of a dot product (16-long for Q6_K,
whose scales cover 16 weights) is an exact integer sum, scaled once by the weight's and the
activation's scales (plus the Q4_1 / Q4_K / Q5_K offset times the activation block's sum). The
native kernel (`cpu/int8_gemm.c`, `cpu/int8_kquants.c`) multiplies 32 byte pairs per
instruction where the float kernel does 8, on weights repacked once into groups of 8 rows.

The cost is x's rounding (relative error about 0.4% of a block's largest entry); the results
are the same whatever the batch: each row is quantized alone and each output summed in one
fixed order. `int8_linear_reference` computes the same arithmetic in torch (the tests' oracle).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..native.cpu_native import native_library
from .bf16_tiles import bf16_tiled_linear
from .fixed_sum import FixedSumWeight, FloatMatrix, fixed_sum_linear
from .int8_packed import GROUP_ROWS, Int8PackedWeight, packed_bytes
from .quant_matmul import (
    QK,
    QuantizedWeight,
    block_fields,
    dequantize_reference,
    linear_operands,
    quant_linear,
)


def pack_int8(w: QuantizedWeight, num_threads: int | None = None) -> Int8PackedWeight:
    """Repack GGUF blocks for the int8 kernel (blocking, about a second per 100 MB)."""
    n, k = w.out_features, w.in_features
    out = torch.empty(packed_bytes(w.fmt, n, k), dtype=torch.uint8)
    threads = num_threads or torch.get_num_threads()
    native_library().int8_pack(int(w.fmt), w.blocks.data_ptr(), out.data_ptr(), n, k, threads)
    return Int8PackedWeight(w.fmt, out, n, k)


def fusion_problem(parts: list[QuantizedWeight]) -> str | None:
    """Why `pack_int8_rows` cannot make one weight of `parts`, or None where it can: one width,
    at most two runs of formats, and with two, every part but the last a multiple of 8 rows."""
    if len({p.in_features for p in parts}) != 1:
        return "fused quantized weights must share their width"
    formats = [p.fmt for p in parts]
    switches = sum(a != b for a, b in itertools.pairwise(formats))
    if switches > 1:
        return f"a fused weight in more than two runs of formats: {formats}"
    if switches and any(p.out_features % GROUP_ROWS for p in parts[:-1]):
        return "parts in two formats must each have a multiple of 8 rows"
    return None


def pack_int8_rows(
    parts: list[QuantizedWeight], num_threads: int | None = None
) -> Int8PackedWeight:
    """`pack_int8` of the parts' rows one after the other (a fused projection), each packed
    straight into its place: a group of 8 rows never spans two parts when every part but the
    last has a multiple of 8 rows, so the packing of the whole is the packings of the parts end
    to end (no concatenated copy of the blocks). Other row counts go through one copy. The parts
    may be in two formats, one run of each (Q4_K_M's Q4_K q and k beside a Q6_K v): the kernel
    switches format at the second run's first row."""
    problem = fusion_problem(parts)
    if problem is not None:
        raise ValueError(problem)
    first, last = parts[0], parts[-1]
    if any(p.out_features % GROUP_ROWS for p in parts[:-1]):  # one format (fusion_problem)
        return pack_int8(QuantizedWeight.cat(parts), num_threads)
    n, k = sum(p.out_features for p in parts), first.in_features
    rows2 = sum(p.out_features for p in parts if p.fmt != first.fmt)
    sizes = [packed_bytes(p.fmt, p.out_features, k) for p in parts]
    out = torch.empty(sum(sizes), dtype=torch.uint8)
    threads = num_threads or torch.get_num_threads()
    offset = 0
    for p, size in zip(parts, sizes, strict=True):
        native_library().int8_pack(
            int(p.fmt), p.blocks.data_ptr(), out.data_ptr() + offset, p.out_features, k, threads
        )
        offset += size
    return Int8PackedWeight(first.fmt, out, n, k, last.fmt if rows2 else None, rows2)


def int8_linear(
    x: torch.Tensor, w: Int8PackedWeight, going_on: torch.Tensor | None = None
) -> torch.Tensor:  # [M, K] -> [M, N] fp32
    """x @ W^T with x quantized to int8 per 32-block, on the calling thread's torch threads.
    `going_on` (float32 [M, N], contiguous; overwritten and returned): every output's sum
    continues from its value, block after block, so a product over the next slice of K given
    the previous slice's output has the bits of one product over both (the blocks of K are
    summed in order, a lane per output)."""
    x, y = linear_operands("int8_linear", x, w.out_features, w.in_features)
    m, n = y.shape
    if going_on is not None:
        if going_on.shape != y.shape or going_on.dtype != y.dtype or not going_on.is_contiguous():
            raise ValueError(f"int8_linear goes on from a contiguous float32 {tuple(y.shape)}")
        y = going_on
    if m:
        fmt2, rows2 = w.second
        native_library().int8_gemm_split(
            int(w.fmt), int(fmt2), rows2, w.packed.data_ptr(), x.data_ptr(), y.data_ptr(),
            m, n, w.in_features, torch.get_num_threads(), going_on is not None,
        )  # fmt: skip
    return y


@dataclass(frozen=True)
class FixedOrderWeight(FloatMatrix):
    """A float [out_features, in_features] weight multiplied by the Triton matmul of one fixed
    reduction order (`kernels/linear/matmul.py`: no split-K, constant tiles, so an output's sum over K
    does not depend on how many rows the step has): the batch-invariant mode's matrices on the
    Triton backend, where cuBLAS picks its kernel by the shape."""


NativeWeight = QuantizedWeight | Int8PackedWeight
"""A weight served by a native CPU kernel: GGUF blocks (float kernel) or repacked (int8 kernel)."""
BlockWeight = NativeWeight | FixedOrderWeight | FixedSumWeight
"""A weight served by a kernel of its own: a native one's, or a float weight for the
fixed-order Triton matmul or the fixed-sum CPU one."""


def block_linear(x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """x @ W^T through the kernel that serves `w`."""
    if isinstance(w, FixedOrderWeight):
        from .matmul import matmul  # Triton: imported only where such a weight is served

        return matmul(x, w.weight.t())
    if isinstance(w, FixedSumWeight):
        return fixed_sum_linear(x, w.weight)
    if isinstance(w, Int8PackedWeight):
        if w.bf16_rows and x.shape[0] >= w.bf16_rows:
            return bf16_tiled_linear(x, w)
        return int8_linear(x, w)
    return quant_linear(x, w)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q int8-valued float [M, K/32, 32], scale [M, K/32, 1]), the kernel's
    rounding: scale max|x| / 127, q = round(x * (127 / max|x|)), half to even."""
    blocks = x.float().reshape(x.shape[0], x.shape[1] // QK, QK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(blocks * inv), amax / 127.0


def int8_linear_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """The int8 kernel's arithmetic in float64: an exact integer sum per sub-block of the
    weights (32 weights, or Q6_K's 16: half a block of x), then the scales."""
    q, dx = quantize_activations(x)  # [M, nb, 32], [M, nb, 1]
    d, m, qw = block_fields(w)  # [N, G, 1], [N, G, 1] or None, [N, G, S]
    rows, groups, size = x.shape[0], qw.shape[1], qw.shape[2]
    sums = torch.einsum(
        "mgk,ngk->mng", q.reshape(rows, groups, size).double(), qw.double()
    )  # exact integers
    dxb = dx.squeeze(-1)  # [M, nb]
    dxg = dxb.repeat_interleave(QK // size, dim=1)  # [M, G]: each sub-block's block of x
    # the kernel rounds d * dx and dx * sum(q) to float32 before it uses them
    scale = (d.squeeze(-1)[None] * dxg[:, None]).double()  # [M, N, G]
    y = (sums * scale).sum(-1)
    if m is not None:
        assert size == QK, "offsets are per block of x"
        sx = (dxb * q.sum(-1)).double()  # [M, nb]
        y = y + sx @ m.squeeze(-1).double().t()
    return y.float()


def int8_error_bound(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """|y_int8 - y_float| is at most sum_k |w_k| * dx_k / 2 (each x off by half a step): [M, N]."""
    _, dx = quantize_activations(x)
    step = dx.expand(-1, -1, QK).reshape(x.shape[0], -1)  # [M, K]
    return (step / 2) @ dequantize_reference(w).abs().t()
