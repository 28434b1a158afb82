"""rms_norm and fused_add_rms_norm against a float64 evaluation of the references."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from deepinfer.kernels.dispatch import KernelInputError
from deepinfer.kernels.elementwise.norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)

Close = Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]
EPS = 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "dim"), [(1, 64), (7, 576), (3, 100)])
def test_rms_norm(assert_close: Close, dtype: torch.dtype, rows: int, dim: int) -> None:
    x = (torch.randn(rows, 2 * dim) * 3).to(dtype)[:, :dim]  # strided rows
    weight = (torch.rand(dim) + 0.5).to(dtype)
    out = torch.full((rows, dim), float("nan"), dtype=dtype)
    result = rms_norm(x, weight, EPS, out=out)
    assert result is out
    assert_close(out, rms_norm_reference(x.double(), weight.double(), EPS), dtype)


def test_rms_norm_per_head(assert_close: Close) -> None:
    """q/k norms: [T, H, D] views of a fused projection, one row per head."""
    qkv = torch.randn(5, 3 * 4 * 32) * 3
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    weight = torch.rand(32) + 0.5
    got = rms_norm(q, weight, EPS)
    assert got.shape == q.shape
    assert_close(got, rms_norm_reference(q.double(), weight.double(), EPS), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (5, 48)])
def test_fused_add_rms_norm(assert_close: Close, dtype: torch.dtype, rows: int, dim: int) -> None:
    x, residual = torch.randn(rows, dim).to(dtype), torch.randn(rows, dim).to(dtype)
    weight = (torch.rand(dim) + 0.5).to(dtype)
    out = torch.full((rows, dim), float("nan"), dtype=dtype)
    summed = torch.full((rows, dim), float("nan"), dtype=dtype)
    fused_add_rms_norm(x, residual, weight, EPS, out=out, summed_out=summed)
    ref_out, ref_summed = fused_add_rms_norm_reference(
        x.double(), residual.double(), weight.double(), EPS
    )
    assert_close(summed, ref_summed, dtype)
    assert_close(out, ref_out, dtype)


def test_fused_add_rms_norm_in_place_residual(assert_close: Close) -> None:
    x, residual, weight = torch.randn(4, 64), torch.randn(4, 64), torch.rand(64)
    expected_out, expected_summed = fused_add_rms_norm_reference(
        x.double(), residual.double(), weight.double(), EPS
    )
    out, summed = fused_add_rms_norm(x, residual, weight, EPS, summed_out=residual)
    assert summed is residual
    assert_close(residual, expected_summed, torch.float32)
    assert_close(out, expected_out, torch.float32)


def test_mixed_dtypes_promote_like_the_reference() -> None:
    x, weight = torch.randn(2, 32).bfloat16(), torch.rand(32)
    result = rms_norm(x, weight, EPS)
    expected = rms_norm_reference(x, weight, EPS)
    assert result.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(result, expected, atol=1e-2, rtol=1e-2)


def test_norm_validation() -> None:
    x, weight = torch.randn(2, 32), torch.rand(32)
    with pytest.raises(KernelInputError, match="weight has 16 rows"):
        rms_norm(x, torch.rand(16), EPS)
    with pytest.raises(KernelInputError, match="2 dimensions"):
        rms_norm(torch.randn(32), weight, EPS)
    with pytest.raises(KernelInputError, match="contiguous"):
        rms_norm(torch.randn(32, 2).t(), weight, EPS)
    with pytest.raises(KernelInputError, match="residual must have the shape"):
        fused_add_rms_norm(x, torch.randn(3, 32), weight, EPS)
    with pytest.raises(KernelInputError, match="out must have shape"):
        rms_norm(x, weight, EPS, out=torch.empty(2, 31))
