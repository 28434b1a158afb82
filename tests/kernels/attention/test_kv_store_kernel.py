"""store_kv against store_kv_reference: every written slot exact, every other slot untouched."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.attention.kv_store import store_kv, store_kv_reference
from deepinfer.kernels.dispatch import KernelInputError


def _poisoned_cache(
    num_blocks: int, block_size: int, heads: int, dim: int, dtype: torch.dtype
) -> torch.Tensor:
    return torch.full((num_blocks, block_size, heads, dim), float("nan"), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_tokens", "block_size", "heads", "dim"),
    [(1, 16, 3, 64), (37, 16, 1, 32), (20, 8, 5, 24)],
)
def test_store_kv_matches_reference(
    seed: int, dtype: torch.dtype, num_tokens: int, block_size: int, heads: int, dim: int
) -> None:
    num_blocks = 8
    k_cache = _poisoned_cache(num_blocks, block_size, heads, dim, dtype)
    v_cache = _poisoned_cache(num_blocks, block_size, heads, dim, dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    # The last slot of block 0, the first of block 1, a padding token (skipped), random slots.
    special = torch.tensor([block_size - 1, block_size, -1])
    others = torch.randperm(num_blocks * block_size)
    others = others[(others != block_size - 1) & (others != block_size)]
    slots = torch.cat([special, others])[:num_tokens]
    # k is a strided view (a slice of a fused KV projection), v contiguous.
    k = torch.randn(num_tokens, 2 * heads, dim).to(dtype)[:, :heads]
    v = torch.randn(num_tokens, heads, dim).to(dtype)
    store_kv(k, v, k_cache, v_cache, slots)
    store_kv_reference(k, v, ref_k, ref_v, slots)
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0, equal_nan=True)
    written = int((slots >= 0).sum())
    assert int((~k_cache.isnan()).all(-1).all(-1).sum()) == written


def test_store_kv_int32_slots() -> None:
    k_cache = _poisoned_cache(2, 4, 1, 16, torch.float32)
    v_cache = k_cache.clone()
    k, v = torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    store_kv(k, v, k_cache, v_cache, torch.tensor([7, 0, 3], dtype=torch.int32))
    assert torch.equal(k_cache.view(8, 1, 16)[[7, 0, 3]], k)
    assert torch.equal(v_cache.view(8, 1, 16)[[7, 0, 3]], v)


def test_store_kv_validation() -> None:
    k_cache = torch.zeros(2, 4, 2, 16)
    v_cache = torch.zeros(2, 4, 2, 16)
    k = torch.zeros(3, 2, 16)
    slots = torch.arange(3)
    with pytest.raises(KernelInputError, match="k must be"):
        store_kv(torch.zeros(3, 1, 16), k, k_cache, v_cache, slots)
    with pytest.raises(KernelInputError, match="dtype"):
        store_kv(k.bfloat16(), k, k_cache, v_cache, slots)
    with pytest.raises(KernelInputError, match="one slot per token"):
        store_kv(k, k, k_cache, v_cache, torch.arange(2))
    with pytest.raises(KernelInputError, match="slot_mapping must have dtype"):
        store_kv(k, k, k_cache, v_cache, slots.float())
    with pytest.raises(KernelInputError, match="same shape"):
        store_kv(k, k, k_cache, torch.zeros(3, 4, 2, 16), slots)
    with pytest.raises(KernelInputError, match="contiguous"):
        store_kv(k, k, k_cache, v_cache.transpose(2, 3).contiguous().transpose(2, 3), slots)
