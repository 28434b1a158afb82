"""apply_rotary (in place) against a float64 evaluation of apply_rotary_reference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from deepinfer.kernels.dispatch import KernelInputError
from deepinfer.kernels.elementwise.rotary import (
    apply_rotary,
    apply_rotary_reference,
    rotary_cos_sin,
)

Close = Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "dim"), [(1, 9, 3, 64), (13, 4, 1, 256), (6, 2, 2, 24)]
)
def test_apply_rotary(
    assert_close: Close, dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, dim: int
) -> None:
    cos_sin = rotary_cos_sin(dim, 4096, 100000.0, torch.get_default_device())
    positions = torch.randint(0, 4096, (tokens,))
    # q and k are views into one fused QKV buffer, as the model produces them.
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim).to(dtype)
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    ref_q, ref_k = q.double(), k.double()
    untouched = qkv[:, heads + kv_heads :].clone()
    apply_rotary_reference(ref_q, ref_k, positions, cos_sin.double())
    apply_rotary(q, k, positions, cos_sin)
    assert_close(q, ref_q, dtype)
    assert_close(k, ref_k, dtype)
    assert torch.equal(qkv[:, heads + kv_heads :], untouched)


def test_rotary_validation() -> None:
    device = torch.get_default_device()
    cos_sin = rotary_cos_sin(16, 8, 10000.0, device)
    q, k, positions = torch.randn(3, 2, 16), torch.randn(3, 1, 16), torch.arange(3)
    with pytest.raises(KernelInputError, match="cos_sin must be"):
        apply_rotary(q, k, positions, rotary_cos_sin(32, 8, 10000.0, device))
    with pytest.raises(KernelInputError, match="cos_sin must have dtype"):
        apply_rotary(q, k, positions, cos_sin.double())
    with pytest.raises(KernelInputError, match="one entry per token"):
        apply_rotary(q, k, torch.arange(2), cos_sin)
    with pytest.raises(KernelInputError, match="even"):
        apply_rotary(torch.randn(3, 2, 15), torch.randn(3, 1, 15), positions, cos_sin)
    with pytest.raises(KernelInputError, match="k must have dtype"):
        apply_rotary(q, k.bfloat16(), positions, cos_sin)
