"""Expert parallelism never changes outputs: a model's logits with its experts over 1, 2 or 4
groups, with or without replicas, and with placements swapped between steps, equal the logits
with every expert in one place (bitwise where experts are served in GGUF blocks, whose rows are
independent of each other; within float rounding for float32 matmuls)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from deepinfer.kernels.linear.fixed_sum import fixed_sum_linear
from deepinfer.model import load_model
from deepinfer.model.experts.moe import MoEForCausalLM
from deepinfer.model.experts.parallel import ExpertParallel, LocalGroup, initial_placement
from deepinfer.model.experts.placement import Placement
from tests.model.model_test_utils import (
    SequentialBlocks,
    bind_fresh_caches,
    prefill_then_decode_logits,
)
from tests.model.test_gguf_moe import write_moe_gguf
from tests.model.test_moe import COMMON, _prompts, randomize

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_moe() -> Any:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        **COMMON, head_dim=32, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=True, tie_word_embeddings=False,
    )  # fmt: skip
    hf_model = transformers.AutoModelForCausalLM.from_config(config)
    randomize(hf_model)
    return hf_model.eval()


@pytest.fixture(scope="module")
def q8_path(hf_moe: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ep") / "q8-experts.gguf"
    q8 = gguf.GGMLQuantizationType.Q8_0
    write_moe_gguf(path, "qwen3_moe", hf_moe, experts_as=q8, every_matrix=True)
    return path


def _parallel(
    model: MoEForCausalLM, groups: int, redundant: int = 0, eplb_interval: int = 0
) -> ExpertParallel:
    assert model.arch.moe is not None
    runners = model.layer_runners()
    parallel = ExpertParallel(
        [LocalGroup(torch.device("cpu"), runners.__getitem__) for _ in range(groups)],
        {
            layer: initial_placement(model.arch.moe.num_experts, groups, redundant)
            for layer in model.blocks()
        },
        eplb_interval=eplb_interval,
        redundant=redundant,
    )
    model.set_expert_parallel(parallel)
    return parallel


def _logits(model: Any) -> list[torch.Tensor]:
    bind_fresh_caches(model, num_blocks=64, block_size=4)
    return prefill_then_decode_logits(model, SequentialBlocks(4), _prompts(), [7, 2, 30])


@pytest.mark.parametrize(
    ("groups", "redundant", "eplb_interval"), [(2, 0, 0), (4, 0, 0), (2, 2, 1), (4, 4, 1)]
)
def test_groups_give_bitwise_the_same_logits(
    q8_path: Path, groups: int, redundant: int, eplb_interval: int
) -> None:
    loaded = load_model(q8_path, torch.float32, "cpu")
    model = loaded.model
    assert isinstance(model, MoEForCausalLM) and model.blocks()[0].quantized is not None
    want = _logits(model)
    parallel = _parallel(model, groups, redundant, eplb_interval)
    got = _logits(model)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    if eplb_interval:  # the placements moved between the steps of that run
        assert parallel.stats.swaps > 0
        assert all(p.num_groups == groups for p in parallel.placements.values())
    parallel.close()


def test_float_experts_over_groups_within_rounding(hf_moe: Any, tmp_path: Path) -> None:
    hf_moe.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path, torch.float32, "cpu").model
    assert isinstance(model, MoEForCausalLM)
    want = _logits(model)
    parallel = _parallel(model, 4, redundant=4, eplb_interval=1)
    got = _logits(model)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert parallel.stats.swaps > 0
    parallel.close()


def test_every_group_computes_only_its_experts(q8_path: Path) -> None:
    """Groups hold disjoint experts (no replicas): each group's runs name only its own experts,
    and every sorted row is computed exactly once."""
    model = load_model(q8_path, torch.float32, "cpu").model
    assert isinstance(model, MoEForCausalLM)
    parallel = _parallel(model, 4)
    seen: list[tuple[int, int, int, int]] = []
    for g, group in enumerate(parallel.groups):
        original = group.run

        def spy(
            layer: int, rows: torch.Tensor, slices: Any, g: int = g, run: Any = original
        ) -> Any:
            seen.extend((g, s.expert, s.start, s.count) for s in slices)
            return run(layer, rows, slices)

        group.run = spy  # type: ignore[method-assign]
    _logits(model)
    placement: Placement = parallel.placements[0]
    assert {g for g, *_ in seen} == {0, 1, 2, 3}
    assert all(expert in placement.groups[g] for g, expert, _, _ in seen)
    parallel.close()


def test_batch_invariant_mode_is_bitwise_at_any_batch_and_any_groups(q8_path: Path) -> None:
    """`--batch-invariant` on CPU: the float32 routers go through the fixed-sum matmul, so a
    prompt's logits are the same bits alone or batched with others, and over 4 groups with
    replicas re-placed every step."""
    loaded = load_model(q8_path, torch.float32, "cpu", batch_invariant=True)
    model = loaded.model
    assert isinstance(model, MoEForCausalLM) and loaded.batch_invariant
    assert all(block.router.quantized is not None for block in model.blocks().values())
    batched = _logits(model)
    for i, (prompt, n) in enumerate(zip(_prompts(), [7, 2, 30], strict=True)):
        bind_fresh_caches(model, num_blocks=64, block_size=4)
        (alone,) = prefill_then_decode_logits(model, SequentialBlocks(4), [prompt], [n])
        assert torch.equal(alone, batched[i])
    parallel = _parallel(model, 4, redundant=4, eplb_interval=1)
    for g, w in zip(_logits(model), batched, strict=True):
        assert torch.equal(g, w)
    assert parallel.stats.swaps > 0
    parallel.close()


def test_fixed_sum_rows_do_not_depend_on_the_batch_or_threads() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(64, 200), torch.randn(50, 200)
    full = fixed_sum_linear(x, w)
    torch.testing.assert_close(full, x @ w.t(), atol=1e-4, rtol=1e-5)
    threads = torch.get_num_threads()
    try:
        for n, t in ((1, 1), (7, 2), (50, 1)):
            torch.set_num_threads(t)
            assert torch.equal(fixed_sum_linear(x[:n], w), full[:n])
    finally:
        torch.set_num_threads(threads)
