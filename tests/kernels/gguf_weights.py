"""Random GGUF weights for the native matmul tests, as a file holds them: Q4_1 and Q8_0 quantized
by gguf-py; K-quant superblocks (which gguf-py reads but does not write) built byte by byte."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from deepinfer.kernels.linear.quant_matmul import QuantFormat, QuantizedWeight
from deepinfer.kernels.native.cpu_native import native_available

needs_native = pytest.mark.skipif(not native_available(), reason="no native CPU kernels here")
GGML = {
    QuantFormat.Q4_1: gguf.GGMLQuantizationType.Q4_1,
    QuantFormat.Q8_0: gguf.GGMLQuantizationType.Q8_0,
    QuantFormat.Q4_K: gguf.GGMLQuantizationType.Q4_K,
    QuantFormat.Q5_K: gguf.GGMLQuantizationType.Q5_K,
    QuantFormat.Q6_K: gguf.GGMLQuantizationType.Q6_K,
}
K_QUANTS = (QuantFormat.Q4_K, QuantFormat.Q5_K, QuantFormat.Q6_K)
FP16_FIELDS = {QuantFormat.Q4_K: (0, 2), QuantFormat.Q5_K: (0, 2), QuantFormat.Q6_K: (208,)}
"""Byte offsets of each K-quant superblock's float16 fields (d, dmin; Q6_K's d is last)."""
UNIT = {QuantFormat.Q4_K: 2.0**-9, QuantFormat.Q5_K: 2.0**-10, QuantFormat.Q6_K: 2.0**-12}
"""A d (and dmin) that gives weights of about 1 from random scales and quants."""


def width(fmt: QuantFormat, blocks: int) -> int:
    """In features of `blocks` whole blocks of `fmt` (32 weights each, 256 for K-quants)."""
    return blocks * fmt.block_weights


def finite_fp16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random float16 bit patterns of every sign, exponent and mantissa but inf and NaN."""
    bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    top = (bits >> 10) & 0x1F == 0x1F
    bits[top] &= np.uint16(0xBFFF)  # exponent 31 -> 15
    return bits.view(np.float16)


def kquant_blocks(fmt: QuantFormat, n: int, k: int, seed: int, wide: bool = False) -> np.ndarray:
    """uint8 [n, k / 256 * B] superblocks, every byte random but the float16 fields: about UNIT
    (times 0.25-1, weights of about 1), or any finite float16 when `wide`."""
    rng = np.random.default_rng(seed)
    shape = (n, k // 256)
    raw = rng.integers(0, 256, (*shape, fmt.block_bytes), dtype=np.uint8)
    for at in FP16_FIELDS[fmt]:
        if wide:
            values = finite_fp16(rng, shape)
        else:
            values = (UNIT[fmt] * rng.uniform(0.25, 1.0, shape)).astype(np.float16)
        raw[..., at : at + 2] = values.view(np.uint8).reshape(*shape, 2)
    return raw.reshape(n, -1)


def gguf_weight(fmt: QuantFormat, n: int, k: int, seed: int) -> tuple[QuantizedWeight, np.ndarray]:
    """Random [n, k] weights in `fmt`, and gguf-py's dequantization of them."""
    if fmt in K_QUANTS:
        blocks = kquant_blocks(fmt, n, k, seed)
    else:
        dense = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
        blocks = gguf.quants.quantize(dense, GGML[fmt])
    expected = gguf.quants.dequantize(blocks, GGML[fmt]).astype(np.float32)
    return QuantizedWeight(fmt, torch.from_numpy(np.ascontiguousarray(blocks)), k), expected
