"""Random GGUF weights for the native matmul tests: quantized by gguf-py, as a file holds them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from deepinfer.kernels.cpu_native import native_available
from deepinfer.kernels.quant_matmul import QuantFormat, QuantizedWeight

needs_native = pytest.mark.skipif(not native_available(), reason="no native CPU kernels here")
GGML = {
    QuantFormat.Q4_1: gguf.GGMLQuantizationType.Q4_1,
    QuantFormat.Q8_0: gguf.GGMLQuantizationType.Q8_0,
}


def gguf_weight(fmt: QuantFormat, n: int, k: int, seed: int) -> tuple[QuantizedWeight, np.ndarray]:
    """Random [n, k] weights quantized by gguf-py, and gguf-py's dequantization of them."""
    dense = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = gguf.quants.quantize(dense, GGML[fmt])
    expected = gguf.quants.dequantize(blocks, GGML[fmt]).astype(np.float32)
    return QuantizedWeight(fmt, torch.from_numpy(np.ascontiguousarray(blocks)), k), expected
