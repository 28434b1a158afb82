"""The native quantized matmul (kernels/cpu/quant_gemm.c) against float64 products of gguf-py's
dequantized weights, and `dequantize_reference` against gguf-py itself, for every format: Q4_1
and Q8_0 quantized by gguf-py, the K-quants (Q4_K, Q5_K, Q6_K) built byte by byte."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from deepinfer.kernels.linear.quant_matmul import (
    QuantFormat,
    QuantizedWeight,
    dequantize,
    dequantize_reference,
    quant_linear,
    quant_linear_reference,
)
from deepinfer.kernels.native.cpu_native import native_available
from tests.kernels.gguf_weights import (
    GGML,
    K_QUANTS,
    gguf_weight,
    kquant_blocks,
    needs_native,
    width,
)


@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_dequantize_is_gguf_py_bit_for_bit(fmt: QuantFormat) -> None:
    w, expected = gguf_weight(fmt, 37, width(fmt, 3), seed=1)
    assert torch.equal(dequantize_reference(w), torch.from_numpy(expected))
    if native_available():
        assert torch.equal(dequantize(w), torch.from_numpy(expected))


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_k_quants_dequantize_bit_for_bit_at_any_scale(fmt: QuantFormat) -> None:
    """Every finite float16 d and dmin (subnormal to 65504, either sign), every scale, min and
    quant byte: the products are exact, the one rounding (of the min's subtraction) is gguf-py's."""
    blocks = kquant_blocks(fmt, 64, width(fmt, 4), seed=2, wide=True)
    want = torch.from_numpy(gguf.quants.dequantize(blocks, GGML[fmt]).astype(np.float32))
    w = QuantizedWeight(fmt, torch.from_numpy(blocks), width(fmt, 4))
    assert torch.equal(dequantize_reference(w), want)
    if native_available():
        assert torch.equal(dequantize(w), want)


@needs_native
@pytest.mark.parametrize("fmt", list(QuantFormat))
@pytest.mark.parametrize("n", [37, 38, 39])  # partial tiles of the kernel's 4 rows
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 7, 32, 33, 70])
def test_quant_linear_matches_float64(fmt: QuantFormat, n: int, m: int) -> None:
    k = width(fmt, 3)
    w, dense = gguf_weight(fmt, n, k, seed=2)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = quant_linear(x, w)
    assert got.shape == (m, n) and got.dtype == torch.float32
    want = x.double() @ torch.from_numpy(dense).double().t()
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    # The torch reference is float32 too: it meets the same float64 bound (its own rounding, so
    # the two float32 results may differ from each other by up to both errors together).
    reference = quant_linear_reference(x, w)
    torch.testing.assert_close(reference.double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got, reference, atol=4e-5, rtol=4e-5)


@needs_native
@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_rows_do_not_depend_on_the_batch(fmt: QuantFormat) -> None:
    """Each output is one fixed reduction whatever M is: a row alone equals it in any batch."""
    k = width(fmt, 18 if fmt.block_weights == 32 else 3)
    w, _ = gguf_weight(fmt, 63, k, seed=3)
    x = torch.randn(70, k)
    together = quant_linear(x, w)
    for m in (0, 1, 2, 31, 32, 69):
        assert torch.equal(quant_linear(x[m : m + 1], w), together[m : m + 1])
    for lo, hi in ((5, 12), (0, 2), (1, 4), (30, 63), (0, 33)):
        assert torch.equal(quant_linear(x[lo:hi], w), together[lo:hi])


@needs_native
def test_threads_do_not_change_results() -> None:
    w, _ = gguf_weight(QuantFormat.Q8_0, 130, 64, seed=4)
    x = torch.randn(9, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant_linear(x, w)
        torch.set_num_threads(2)
        two = quant_linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_bad_weights_and_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight(QuantFormat.Q4_1, torch.zeros(2, 20, dtype=torch.uint8), 48)
    with pytest.raises(ValueError, match="Q6_K in_features must be a positive multiple of 256"):
        QuantizedWeight(QuantFormat.Q6_K, torch.zeros(2, 210, dtype=torch.uint8), 128)
    with pytest.raises(ValueError, match=r"Q4_K blocks must be contiguous uint8 \[N, 288\]"):
        QuantizedWeight(QuantFormat.Q4_K, torch.zeros(2, 144, dtype=torch.uint8), 512)
    with pytest.raises(ValueError, match=r"uint8 \[N, 40\]"):
        QuantizedWeight(QuantFormat.Q4_1, torch.zeros(2, 34, dtype=torch.uint8), 64)
    w, _ = gguf_weight(QuantFormat.Q4_1, 4, 64, seed=5)
    with pytest.raises(ValueError, match="float32 CPU"):
        quant_linear(torch.zeros(2, 64, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="cannot multiply"):
        quant_linear(torch.zeros(2, 32), w)
    with pytest.raises(ValueError, match="share their format"):
        QuantizedWeight.cat([w, gguf_weight(QuantFormat.Q8_0, 4, 64, seed=6)[0]])


def test_cat_stacks_rows() -> None:
    a, da = gguf_weight(QuantFormat.Q4_1, 5, 64, seed=7)
    b, db = gguf_weight(QuantFormat.Q4_1, 3, 64, seed=8)
    fused = QuantizedWeight.cat([a, b])
    assert fused.out_features == 8
    assert torch.equal(dequantize_reference(fused), torch.from_numpy(np.concatenate([da, db])))
