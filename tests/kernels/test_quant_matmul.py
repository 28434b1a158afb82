"""The native quantized matmul (kernels/cpu/quant_gemm.c) against float64 products of gguf-py's
dequantized weights, and `dequantize_reference` against gguf-py itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_weights import gguf_weight, needs_native

from deepinfer.kernels.quant_matmul import (
    QuantFormat,
    QuantizedWeight,
    dequantize_reference,
    quant_linear,
    quant_linear_reference,
)


@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_dequantize_reference_is_gguf_py_bit_for_bit(fmt: QuantFormat) -> None:
    w, expected = gguf_weight(fmt, 37, 96, seed=1)
    assert torch.equal(dequantize_reference(w), torch.from_numpy(expected))


@needs_native
@pytest.mark.parametrize("fmt", list(QuantFormat))
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 7, 32, 70])
def test_quant_linear_matches_float64(fmt: QuantFormat, m: int) -> None:
    w, dense = gguf_weight(fmt, 37, 96, seed=2)  # 37 rows: a partial tile of the kernel's 4
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
    got = quant_linear(x, w)
    assert got.shape == (m, 37) and got.dtype == torch.float32
    want = x.double() @ torch.from_numpy(dense).double().t()
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got, quant_linear_reference(x, w), atol=2e-5, rtol=2e-5)


@needs_native
def test_rows_do_not_depend_on_the_batch() -> None:
    """Each output is one fixed reduction whatever M is: a row alone equals it in any batch."""
    w, _ = gguf_weight(QuantFormat.Q4_1, 64, 576, seed=3)
    x = torch.randn(33, 576)
    together = quant_linear(x, w)
    for m in (0, 1, 2, 31, 32):
        assert torch.equal(quant_linear(x[m : m + 1], w), together[m : m + 1])
    assert torch.equal(quant_linear(x[5:12], w), together[5:12])


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
