"""Linear layers over GGUF block-quantized weights, kept quantized in memory.

A quantized weight is its file's blocks, row by row: `blocks` is `uint8 [N, K / W * B]` for
blocks of W weights in B bytes: Q4_1 (W = 32, B = 20: fp16 d, fp16 m, 16 bytes of nibbles),
Q8_0 (32, 34: fp16 d, 32 int8), and the K-quants' superblocks Q4_K (256, 144), Q5_K (256, 176)
and Q6_K (256, 210) (layouts in `cpu/blocks.h`). `quant_linear` multiplies by it on CPU through
the native AVX2 kernel (`cpu/quant_gemm.c`), which dequantizes tiles of rows on the fly: the
weights read per step are 4-7x smaller than fp32, and the values multiplied are exactly
`dequantize_reference`'s (gguf-py's). `quant_linear_reference` is the plain-torch path and the
tests' oracle.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..native.cpu_native import native_available, native_library
from .kquants import QK_K, q4_k_fields, q5_k_fields, q6_k_fields

QK = 32
"""Weights per block of Q4_1 and Q8_0, and per block of x in the int8 kernel."""
_BLOCKS = {0: (QK, 20), 1: (QK, 34), 2: (QK_K, 144), 3: (QK_K, 176), 4: (QK_K, 210)}


class QuantFormat(enum.IntEnum):
    """Block formats, numbered as the native kernel expects."""

    Q4_1 = 0
    Q8_0 = 1
    Q4_K = 2
    Q5_K = 3
    Q6_K = 4

    @property
    def block_weights(self) -> int:
        return _BLOCKS[self.value][0]

    @property
    def block_bytes(self) -> int:
        return _BLOCKS[self.value][1]


@dataclass(frozen=True)
class QuantizedWeight:
    """A [out_features, in_features] weight as contiguous blocks, row after row."""

    fmt: QuantFormat
    blocks: torch.Tensor  # uint8 [out_features, in_features / W * block_bytes], contiguous CPU
    in_features: int

    def __post_init__(self) -> None:
        b, per = self.blocks, self.fmt.block_weights
        if self.in_features <= 0 or self.in_features % per:
            raise ValueError(f"{self.fmt.name} in_features must be a positive multiple of {per}")
        row = self.in_features // per * self.fmt.block_bytes
        if b.dtype != torch.uint8 or b.dim() != 2 or b.shape[1] != row or not b.is_contiguous():
            raise ValueError(
                f"{self.fmt.name} blocks must be contiguous uint8 [N, {row}], got "
                f"{b.dtype} {tuple(b.shape)}"
            )

    @property
    def out_features(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Row-wise concatenation (fused projections); formats and widths must agree."""
        first = parts[0]
        if any(p.fmt != first.fmt or p.in_features != first.in_features for p in parts):
            raise ValueError("fused quantized weights must share their format and width")
        blocks = torch.cat([p.blocks for p in parts]) if len(parts) > 1 else first.blocks
        return QuantizedWeight(first.fmt, blocks, first.in_features)


_K_FIELDS = {
    QuantFormat.Q4_K: q4_k_fields,
    QuantFormat.Q5_K: q5_k_fields,
    QuantFormat.Q6_K: q6_k_fields,
}


def block_fields(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The weights' fields as float32 over G sub-blocks a row, each of one scale: scale
    [N, G, 1], offset [N, G, 1] (None for Q8_0 and Q6_K) and the integer weights q [N, G, K / G];
    a weight is scale * q (+ offset). Sub-blocks are 32 weights (16 for Q6_K): Q4_1 and Q8_0's
    blocks with their d (and m), the K-quants' d * sc (and -(dmin * m))."""
    n, nb = w.out_features, w.in_features // w.fmt.block_weights
    raw = w.blocks.view(n, nb, w.fmt.block_bytes)
    if w.fmt in _K_FIELDS:
        return _K_FIELDS[w.fmt](raw)
    d = raw[..., 0:2].contiguous().view(torch.float16).float()
    if w.fmt is QuantFormat.Q8_0:
        return d, None, raw[..., 2:].contiguous().view(torch.int8).float()
    m = raw[..., 2:4].contiguous().view(torch.float16).float()
    qs = raw[..., 4:]  # [N, nb, 16]: low nibbles are weights 0-15, high nibbles 16-31
    return d, m, torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()


def dequantize_reference(w: QuantizedWeight) -> torch.Tensor:  # float32 [N, K]
    """The fp32 weights, computed as gguf-py computes them (a multiply, then the add; adding
    the K-quants' offset -(dmin * m) is subtracting dmin * m, to the bit)."""
    d, m, q = block_fields(w)
    weights = d * q if m is None else d * q + m
    return weights.reshape(w.out_features, w.in_features)


def dequantize(w: QuantizedWeight) -> torch.Tensor:  # float32 [N, K]
    """The same fp32 weights as `dequantize_reference`, through the native kernel where it
    builds (model loading: a tenth of the time of numpy's or torch's several passes)."""
    if not native_available():
        return dequantize_reference(w)
    out = torch.empty((w.out_features, w.in_features), dtype=torch.float32)
    native_library().dequantize(
        int(w.fmt), w.blocks.data_ptr(), out.data_ptr(), w.out_features, w.in_features,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def quant_linear_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return x.float() @ dequantize_reference(w).t()


def linear_operands(
    kernel: str, x: torch.Tensor, out_features: int, in_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x made contiguous and an empty float32 [M, out_features] output, once x is checked to be
    a float32 CPU [M, in_features] matrix (a ValueError naming `kernel` otherwise)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"{kernel} takes float32 CPU [M, K] inputs, got {x.dtype} {x.shape}")
    if x.shape[1] != in_features:
        raise ValueError(
            f"cannot multiply {tuple(x.shape)} by a [{out_features}, {in_features}] weight"
        )
    return x.contiguous(), torch.empty((x.shape[0], out_features), dtype=torch.float32)


def quant_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:  # [M, K] -> [M, N] fp32
    """x @ W^T on CPU through the native kernel, on the calling thread's torch thread count.

    Raises `NativeUnavailableError` when the kernel cannot be built here (check once, at load,
    with `native_library()`). Every output is reduced in one fixed order whatever M is.
    """
    x, y = linear_operands("quant_linear", x, w.out_features, w.in_features)
    m, n = y.shape
    if m:
        native_library().gemm(
            int(w.fmt), w.blocks.data_ptr(), x.data_ptr(), y.data_ptr(), m, n, w.in_features,
            torch.get_num_threads(),
        )  # fmt: skip
    return y
