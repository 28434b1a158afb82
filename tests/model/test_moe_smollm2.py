"""SmolLM2 made a Mixture of Experts (no MoE ships on PyPI): its FFN split into 8 experts of 192
rows with every expert chosen at gate 1, and its FFN replicated behind a random router (top 2 of
3, renormalized gates: uneven routing whose gates sum to 1) both give the dense model's logits,
prefill and decode."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from deepinfer.environment import default_model_path
from deepinfer.model import load_model
from deepinfer.model.arch import MoEArch
from deepinfer.model.experts.moe import MoEForCausalLM
from tests.model.model_test_utils import SequentialBlocks, bind_fresh_caches, run_step

pytestmark = pytest.mark.slow
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def dense() -> Any:
    return load_model(default_model_path(), torch.float32, "cpu", quantized_matmul="off")


def _split(state: dict[str, torch.Tensor], num_layers: int, experts: int) -> dict:
    """Expert j: rows j*s..(j+1)*s of gate and up, the same columns of down."""
    out = {k: v for k, v in state.items() if ".mlp." not in k}
    for i in range(num_layers):
        p = f"layers.{i}.mlp."
        gate, up = state[p + "gate_up_proj.weight"].chunk(2)
        down = state[p + "down_proj.weight"]
        s = gate.shape[0] // experts
        parts = [slice(j * s, (j + 1) * s) for j in range(experts)]
        out[p + "w_gate_up"] = torch.stack([torch.cat([gate[r], up[r]]) for r in parts])
        out[p + "w_down"] = torch.stack([down[:, r] for r in parts])
        out[p + "router.weight"] = torch.zeros(experts, gate.shape[1])
    return out


def _replicate(state: dict[str, torch.Tensor], num_layers: int, experts: int) -> dict:
    """Every expert the dense FFN (stride-0 views: no copies); random routers."""
    g = torch.Generator().manual_seed(0)
    out = {k: v for k, v in state.items() if ".mlp." not in k}
    for i in range(num_layers):
        p = f"layers.{i}.mlp."
        gate_up, down = state[p + "gate_up_proj.weight"], state[p + "down_proj.weight"]
        out[p + "w_gate_up"] = gate_up.expand(experts, *gate_up.shape)
        out[p + "w_down"] = down.expand(experts, *down.shape)
        out[p + "router.weight"] = torch.randn(experts, gate_up.shape[1], generator=g)
    return out


CASES = {
    "split": (MoEArch(8, 8, 192, renormalize=False, routed_scaling=8.0), _split),
    "replicated": (MoEArch(3, 2, 1536, renormalize=True), _replicate),
}


def _logits(model: Any, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt prefilled but its last 3 tokens, then those decoded one a step, batched."""
    bind_fresh_caches(model, num_blocks=64, block_size=BLOCK_SIZE)
    blocks = SequentialBlocks(BLOCK_SIZE)
    pieces = [(r, p[:-3], 0) for r, p in enumerate(prompts)]
    outs = [[x] for x in run_step(model, blocks, pieces, all_rows=True)]
    for j in range(3, 0, -1):
        step = [(r, [p[-j]], len(p) - j) for r, p in enumerate(prompts)]
        for r, logits in enumerate(run_step(model, blocks, step)):
            outs[r].append(logits[None])
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("case", sorted(CASES))
def test_experts_reproduce_the_dense_model(dense: Any, case: str) -> None:
    moe, convert = CASES[case]
    arch = dataclasses.replace(dense.arch, architecture="mixtral", moe=moe)
    model = MoEForCausalLM(arch, torch.device("cpu"))
    state = convert(dense.model.state_dict(), arch.num_layers, moe.num_experts)
    model.load_state_dict(state, strict=True, assign=True)
    model.eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, arch.vocab_size, (n,), generator=g).tolist() for n in (40, 13)]
    for got, want in zip(_logits(model, prompts), _logits(dense.model, prompts), strict=True):
        # float32 sums in another order over 30 layers: logits near 10 differ by ~1e-4
        torch.testing.assert_close(got, want, atol=1e-4, rtol=2e-5)
