"""GGUF block formats the native quantized matmul does not take, repacked losslessly into ones
it does: Q4_0 as Q4_1 and Q5_0 as Q8_0, the same values to the bit."""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.kernels.linear.quant_matmul import QuantFormat
from deepinfer.kernels.native.cpu_native import NativeUnavailableError, native_library

Q4_0_BLOCK_BYTES = 18
"""fp16 d, then 16 bytes of nibbles (the same layout as Q4_1's); a weight is d * (q - 8)."""


def q4_0_as_q4_1(blocks: np.ndarray) -> np.ndarray | None:
    """Q4_0 blocks (uint8 [N, K / 32 * 18]) as Q4_1 blocks of the same values: the same d and
    nibbles, and the offset m = -8 d, exact in fp16 (a power-of-two multiple), so d * q + m is
    d * (q - 8) to the bit in float32. None where some -8 d overflows fp16 (a scale over 8188:
    such a matrix is dequantized instead). Q4_1 blocks are 20 bytes for Q4_0's 18."""
    n, width = blocks.shape
    raw = blocks.reshape(n, width // Q4_0_BLOCK_BYTES, Q4_0_BLOCK_BYTES)
    d = raw[..., :2].copy().view(np.float16)
    with np.errstate(over="ignore"):
        m = (d.astype(np.float32) * -8.0).astype(np.float16)
    if not np.isfinite(m[np.isfinite(d)]).all():
        return None
    out = np.empty((n, raw.shape[1], QuantFormat.Q4_1.block_bytes), dtype=np.uint8)
    out[..., :2] = raw[..., :2]
    out[..., 2:4] = m.view(np.uint8)
    out[..., 4:] = raw[..., 2:]
    return out.reshape(n, -1)


Q5_0_BLOCK_BYTES = 22
"""fp16 d, the 32 weights' fifth bits (a little-endian uint32), 16 bytes of nibbles as Q4_0's;
a weight is d * (q - 16)."""


def q5_0_as_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 blocks (uint8 [N, K / 32 * 22]) as Q8_0 blocks of the same values: the same d and
    the int8 q - 16 (in [-16, 15]), so d * (q - 16) is the same float32 product, to the bit.
    Q8_0 blocks are 34 bytes for Q5_0's 22. The native kernel where it runs (a model's worth in
    a fraction of a second; numpy takes seconds), else `q5_0_as_q8_0_numpy`."""
    try:
        lib = native_library()
    except NativeUnavailableError:
        return q5_0_as_q8_0_numpy(blocks)
    n, width = blocks.shape
    nb = width // Q5_0_BLOCK_BYTES
    src = np.ascontiguousarray(blocks)
    out = np.empty((n, nb * QuantFormat.Q8_0.block_bytes), dtype=np.uint8)
    lib.q5_0_to_q8_0(src.ctypes.data, out.ctypes.data, n * nb, torch.get_num_threads())
    return out


def q5_0_as_q8_0_numpy(blocks: np.ndarray) -> np.ndarray:
    """`q5_0_as_q8_0` in numpy (the reference, and where the native kernels do not run)."""
    n, width = blocks.shape
    raw = blocks.reshape(n, width // Q5_0_BLOCK_BYTES, Q5_0_BLOCK_BYTES)
    fifth = np.unpackbits(raw[..., 2:6], axis=-1, bitorder="little")  # [N, nb, 32]
    nibbles = raw[..., 6:]
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # weights 0-15, then 16-31
    q = (low | (fifth << 4)).astype(np.int8) - np.int8(16)
    out = np.empty((n, raw.shape[1], QuantFormat.Q8_0.block_bytes), dtype=np.uint8)
    out[..., :2] = raw[..., :2]
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(n, -1)
