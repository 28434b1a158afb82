"""The Triton grouped-expert matmul (interpreted on CPU) against the torch grouped FFN: any
number of tokens, experts (some without a token), top k; the padded layout of the pairs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.kernels.moe.moe_grouped import BLOCK_M, align_pairs, triton_grouped_experts
from deepinfer.kernels.moe.moe_torch import expert_counts, float_experts, grouped_experts, route


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@settings(max_examples=12, deadline=None)
@given(
    num_tokens=st.integers(1, 20), num_experts=st.integers(1, 6), data=st.data(),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_triton_grouped_experts_equal_torch(
    num_tokens: int, num_experts: int, data: st.DataObject, seed: int
) -> None:
    top_k = data.draw(st.integers(1, num_experts))
    g = torch.Generator().manual_seed(seed)
    d, i = 40, 24  # not multiples of the tiles
    h = torch.randn(num_tokens, d, generator=g)
    w_gate_up = torch.randn(num_experts, 2 * i, d, generator=g) / 4
    w_down = torch.randn(num_experts, d, i, generator=g) / 4
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits[:, 0] -= 100.0  # expert 0 (when another can be chosen) gets no token
    gates, experts = route(logits, top_k)
    want = grouped_experts(
        h, experts, gates, float_experts(w_gate_up, w_down, _silu_mul),
        expert_counts(experts, num_experts),
    )  # fmt: skip
    got = triton_grouped_experts(h, experts, gates, w_gate_up, w_down, _silu_mul)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_pairs_padded_to_whole_blocks_by_expert() -> None:
    experts = torch.tensor([[2, 0], [2, 1], [0, 2]])  # pairs 0..5
    rows, block_expert = align_pairs(experts, num_experts=4)
    assert block_expert.tolist() == [0, 1, 2]  # expert 3 has no pair, no block
    blocks = rows.view(-1, BLOCK_M).tolist()
    assert blocks[0][:2] == [1, 4] and blocks[1][:1] == [3] and blocks[2][:3] == [0, 2, 5]
    assert all(r == -1 for block, n in zip(blocks, (2, 1, 3), strict=True) for r in block[n:])


def test_no_pairs() -> None:
    rows, block_expert = align_pairs(torch.zeros(0, 2, dtype=torch.int64), num_experts=3)
    assert rows.numel() == 0 and block_expert.numel() == 0
