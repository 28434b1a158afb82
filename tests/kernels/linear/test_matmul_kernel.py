"""matmul against a float64 product, and its batch invariance (rows do not depend on M)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from deepinfer.kernels.dispatch import KernelInputError
from deepinfer.kernels.linear.matmul import matmul

Close = Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 96), (37, 100, 130), (129, 200, 17)])
def test_matmul(assert_close: Close, dtype: torch.dtype, m: int, k: int, n: int) -> None:
    a = (torch.randn(m, k) / math.sqrt(k)).to(dtype)
    b = torch.randn(n, k).to(dtype).t()  # a transposed weight, as in x @ W.T
    out = torch.full((m, n), float("nan"), dtype=dtype)
    assert matmul(a, b, out=out) is out
    assert_close(out, a.double() @ b.double(), dtype)


def test_matmul_rows_independent_of_batch() -> None:
    a, b = torch.randn(150, 96).bfloat16(), torch.randn(96, 40).bfloat16()
    assert torch.equal(matmul(a, b)[:3], matmul(a[:3], b))


def test_matmul_validation() -> None:
    a = torch.randn(4, 8)
    with pytest.raises(KernelInputError, match="cannot multiply"):
        matmul(a, torch.randn(7, 3))
    with pytest.raises(KernelInputError, match="b must have dtype"):
        matmul(a, torch.randn(8, 3).bfloat16())
    with pytest.raises(KernelInputError, match="a must have 2 dimensions"):
        matmul(torch.randn(2, 4, 8), torch.randn(8, 3))
    with pytest.raises(KernelInputError, match="out must have shape"):
        matmul(a, torch.randn(8, 3), out=torch.empty(4, 4))
