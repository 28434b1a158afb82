"""KV cache allocation: on CPU a pool is reserved, not touched (resident memory follows the
blocks written), and reads as zeros everywhere until written."""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.arch import ModelArch
from deepinfer.model.kv_layout import (
    allocate_kv_caches,
    check_kv_caches,
    kv_bytes_per_block,
    reserve_zeros,
)
from tests.resident_pages import AVAILABLE, committed_bytes, tensor_range

BLOCK_SIZE = 16
MIB = 1 << 20


def arch(**overrides: object) -> ModelArch:
    fields: dict[str, object] = dict(
        architecture="llama", num_layers=8, hidden_size=512, intermediate_size=1024, num_heads=8,
        num_kv_heads=4, head_dim=64, vocab_size=1000, rope_theta=1e4, rms_norm_eps=1e-5,
        max_position_embeddings=4096, tie_word_embeddings=True,
    )  # fmt: skip
    fields.update(overrides)
    return ModelArch(**fields)  # type: ignore[arg-type]


def committed(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return committed_bytes(tensor_range(t) for pair in caches for t in pair)


pytestmark = pytest.mark.skipif(not AVAILABLE, reason="reads the caches' pages from /proc")


@pytest.mark.slow
def test_a_large_cpu_pool_is_reserved_not_touched() -> None:
    a = arch()
    num_blocks = (1 << 30) // kv_bytes_per_block(a, BLOCK_SIZE, torch.bfloat16)
    caches = allocate_kv_caches(a, num_blocks, BLOCK_SIZE, torch.bfloat16, "cpu")
    assert committed(caches) == 0
    check_kv_caches(a, caches, torch.bfloat16)
    total = sum(k.numel() * k.element_size() * 2 for k, _ in caches)
    assert total >= (1 << 30) - kv_bytes_per_block(a, BLOCK_SIZE, torch.bfloat16)
    for k, v in caches:  # every byte reads as zero, and reading commits no memory
        assert k.is_contiguous() and not k.any() and not v.any()
    assert committed(caches) == 0


def test_written_blocks_hold_their_values_and_cost_about_their_size() -> None:
    a = arch()
    caches = allocate_kv_caches(a, 4096, BLOCK_SIZE, torch.float16, torch.device("cpu"))
    assert committed(caches) == 0
    for layer, (k, v) in enumerate(caches):
        k[7].fill_(layer + 1)
        v[4095].fill_(-(layer + 1))
    written = kv_bytes_per_block(a, BLOCK_SIZE, torch.float16)  # a block's keys, another's values
    assert written <= committed(caches) < written + 16 * MIB
    for layer, (k, v) in enumerate(caches):
        assert torch.all(k[7] == layer + 1) and torch.all(v[4095] == -(layer + 1))
        assert not k[:7].any() and not k[8:].any() and not v[:4095].any()


def test_window_layers_get_a_pool_of_their_own() -> None:
    a = arch(num_layers=3, layer_windows=(512, 512, 0))
    caches = allocate_kv_caches(a, 10, BLOCK_SIZE, torch.float32, "cpu", num_window_blocks=4)
    assert [k.shape[0] for k, _ in caches] == [4, 4, 10]
    assert [v.shape[0] for _, v in caches] == [4, 4, 10]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_reserve_zeros_matches_torch_zeros(dtype: torch.dtype) -> None:
    cpu = torch.device("cpu")
    for shape in ((3, 5, 7), (0, 4), (1,)):
        got = reserve_zeros(shape, dtype, cpu)
        assert torch.equal(got, torch.zeros(shape, dtype=dtype))
        got.add_(1)  # writable
        assert torch.equal(got, torch.ones(shape, dtype=dtype))
