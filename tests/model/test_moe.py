"""Mixture-of-Experts: tiny random Mixtral, Qwen2-MoE (shared expert, a dense layer) and
Qwen3-MoE checkpoints saved by transformers, loaded here, logits within 1e-4 of transformers' own
implementation (prefill, chunked prefill, decode); the router variants and the grouped expert FFN
against a per-token loop."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.errors import ModelLoadError
from deepinfer.kernels.moe.moe_torch import (
    expert_counts,
    float_experts,
    grouped_experts,
    naive_experts,
    route,
)
from deepinfer.model import load_model
from deepinfer.model.arch import MoEArch
from tests.model.model_test_utils import (
    SequentialBlocks,
    bind_fresh_caches,
    chunked_prefill_logits,
    prefill_then_decode_logits,
    run_step,
)

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4
COMMON = dict(
    vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
)  # fmt: skip


def _config(kind: str) -> Any:
    if kind == "mixtral":
        return transformers.MixtralConfig(
            **COMMON, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2,
            tie_word_embeddings=False,
        )  # fmt: skip
    if kind == "qwen2_moe":  # a dense layer (mlp_only_layers), a shared gated expert
        return transformers.Qwen2MoeConfig(
            **COMMON, intermediate_size=80, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=3, shared_expert_intermediate_size=40, mlp_only_layers=[1],
            norm_topk_prob=False, tie_word_embeddings=True,
        )  # fmt: skip
    if kind == "dots1":  # DeepSeek-V3 routing: sigmoid, choosing bias, 2 of 4 groups; dense layer 0
        return transformers.Dots1Config(
            **COMMON, head_dim=32, intermediate_size=80, moe_intermediate_size=24,
            n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, n_group=4,
            topk_group=2, first_k_dense_replace=1, norm_topk_prob=True,
            routed_scaling_factor=2.5, tie_word_embeddings=False,
        )  # fmt: skip
    if kind == "deepseek_v3":  # latent attention (q and kv latents, interleaved RoPE), YaRN too
        yarn = {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 32,
        }  # fmt: skip
        return transformers.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4}, rope_parameters=yarn, intermediate_size=80, moe_intermediate_size=24, n_routed_experts=8,
            num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2,
            first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
            kv_lora_rank=32, q_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16,
            v_head_dim=16, tie_word_embeddings=False,
        )  # fmt: skip
    return transformers.Qwen3MoeConfig(
        **COMMON, head_dim=32, intermediate_size=80, moe_intermediate_size=24, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
    )  # fmt: skip


def randomize(hf_model: Any) -> None:
    """Random norms and biases; routers and experts large enough that their outputs dominate
    the logits, which are of order 1, not 0.1."""
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.5 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(torch.randn_like(param))
            elif ".mlp." in name:
                param.copy_(0.2 * torch.randn_like(param))
            elif "embed" in name or "lm_head" in name:
                param.copy_(0.5 * torch.randn_like(param))
            elif any(p in name for p in ("q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj")):
                param.copy_(0.3 * torch.randn_like(param))  # latent attention: scores that vary
        for name, buffer in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # chooses experts, never gates them
                buffer.copy_(0.3 * torch.randn_like(buffer))


@pytest.fixture(
    scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe", "dots1", "deepseek_v3"]
)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(_config(request.param))
    randomize(hf_model)
    hf_model.eval()
    directory = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(directory, safe_serialization=True)
    return request.param, directory, hf_model


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in (23, 9, 41)]


def _hf_logits(hf_model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float()  # [T, V]


@pytest.mark.slow
def test_arch_read_from_the_config(tiny: Any) -> None:
    kind, directory, hf_model = tiny
    arch = load_model(directory, torch.float32, "cpu").arch
    assert arch.architecture == kind and arch.moe is not None
    c = hf_model.config
    assert arch.moe.top_k == c.num_experts_per_tok
    assert arch.moe.num_experts == (6 if kind == "mixtral" else 8)
    dense = {"qwen2_moe": (1,), "dots1": (0,), "deepseek_v3": (0,)}.get(kind, ())
    assert arch.moe.dense_layers == dense
    assert arch.moe.shared_gate == (kind == "qwen2_moe")
    assert arch.moe.renormalize == (kind != "qwen2_moe")
    assert [arch.sparse(i) for i in range(3)] == [i not in dense for i in range(3)]
    if kind == "deepseek_v3":  # a head's key: 16 plain and 16 rotary dims; YaRN's scale
        assert arch.mla is not None and (arch.head_dim, arch.num_kv_heads) == (32, 4)
        assert arch.rope_yarn is not None and arch.rope_yarn.factor == 4.0
        assert arch.attention_scale == pytest.approx(32**-0.5 * (0.1 * math.log(4) + 1) ** 2)
    if kind == "dots1":
        m = arch.moe
        assert (m.routing, m.score_bias, m.num_groups, m.topk_groups) == (
            "sigmoid_topk",
            True,
            4,
            2,
        )
        assert (m.routed_scaling, m.shared_intermediate_size) == (2.5, 48)


@pytest.mark.parametrize("mode", ["prefill", "chunked", "decode"])
def test_logits_match_transformers(tiny: Any, mode: str) -> None:
    _, directory, hf_model = tiny
    model = load_model(directory, torch.float32, "cpu").model
    bind_fresh_caches(model, num_blocks=64, block_size=BLOCK_SIZE)
    blocks = SequentialBlocks(BLOCK_SIZE)
    prompts = _prompts()
    if mode == "prefill":  # all prompts in one batch: experts see tokens of three requests
        ours = run_step(model, blocks, [(i, p, 0) for i, p in enumerate(prompts)], all_rows=True)
        expected = [_hf_logits(hf_model, p) for p in prompts]
    elif mode == "chunked":
        ours = chunked_prefill_logits(model, blocks, prompts, chunk=5)
        expected = [_hf_logits(hf_model, p) for p in prompts]
    else:
        prefill_lens = [7, 2, 30]
        ours = prefill_then_decode_logits(model, blocks, prompts, prefill_lens)
        expected = [
            _hf_logits(hf_model, p)[n - 1 :] for p, n in zip(prompts, prefill_lens, strict=True)
        ]
    for got, want in zip(ours, expected, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@settings(max_examples=40, deadline=None)
@given(
    num_tokens=st.integers(1, 12), num_experts=st.integers(1, 9), data=st.data(),
    routing=st.sampled_from(["softmax_topk", "topk_softmax"]), renormalize=st.booleans(),
    scaling=st.sampled_from([1.0, 2.5]), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_grouped_experts_equal_a_per_token_loop(
    num_tokens: int, num_experts: int, data: st.DataObject, routing: str, renormalize: bool,
    scaling: float, seed: int,
) -> None:  # fmt: skip
    top_k = data.draw(st.integers(1, num_experts))
    g = torch.Generator().manual_seed(seed)
    d, i = 16, 8
    h = torch.randn(num_tokens, d, generator=g)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    w_gate_up = torch.randn(num_experts, 2 * i, d, generator=g) / 4
    w_down = torch.randn(num_experts, d, i, generator=g) / 4
    gates, experts = route(logits, top_k, routing, renormalize, scaling)
    # the gates, token by token, as the model families define them
    for t in range(num_tokens):
        chosen = experts[t].tolist()
        assert len(set(chosen)) == top_k
        probs = torch.softmax(logits[t], dim=-1)
        assert min(probs[chosen]) >= max(probs[[e for e in range(num_experts) if e not in chosen]],
                                         default=-1.0)  # fmt: skip
        want = probs[chosen]
        if routing == "topk_softmax" or renormalize:
            want = want / want.sum()
        torch.testing.assert_close(gates[t], want * scaling, atol=1e-6, rtol=1e-5)
    ffn = float_experts(w_gate_up, w_down, _silu_mul)
    counts = expert_counts(experts, num_experts)
    assert counts == [int((experts == e).sum()) for e in range(num_experts)]
    got = grouped_experts(h, experts, gates, ffn, counts)
    want = naive_experts(h, experts, gates, ffn)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_every_expert_counts(tiny: Any) -> None:
    """The comparison above is sensitive to the experts: one expert's weights perturbed by 1%
    moves the logits far past its tolerance."""
    _, directory, _ = tiny
    model: Any = load_model(directory, torch.float32, "cpu").model
    bind_fresh_caches(model, num_blocks=64, block_size=BLOCK_SIZE)
    prompt = _prompts()[2]
    (before,) = run_step(model, SequentialBlocks(BLOCK_SIZE), [(0, prompt, 0)], all_rows=True)
    with torch.no_grad():
        model.layers[2].mlp.w_down[3].mul_(1.01)
    bind_fresh_caches(model, num_blocks=64, block_size=BLOCK_SIZE)
    (after,) = run_step(model, SequentialBlocks(BLOCK_SIZE), [(0, prompt, 0)], all_rows=True)
    assert (after - before).abs().max() > 10 * 1e-4  # ten times the tolerance


@pytest.mark.parametrize("tiny", ["dots1"], indirect=True)
def test_the_choosing_bias_and_the_groups_count(tiny: Any) -> None:
    """DeepSeek-V3 routing: without the choosing bias, or choosing among every group, other
    experts are picked and the logits move far past the comparison's tolerance."""
    _, directory, _ = tiny
    prompt = _prompts()[2]

    def logits(change: Any) -> torch.Tensor:
        model: Any = load_model(directory, torch.float32, "cpu").model
        for layer in model.layers[1:]:
            change(layer.mlp)
        bind_fresh_caches(model, num_blocks=64, block_size=BLOCK_SIZE)
        (out,) = run_step(model, SequentialBlocks(BLOCK_SIZE), [(0, prompt, 0)], all_rows=True)
        return out

    def no_bias(block: Any) -> None:
        block.router_bias.zero_()

    def all_groups(block: Any) -> None:
        block.moe = dataclasses.replace(block.moe, topk_groups=block.moe.num_groups)

    want = logits(lambda block: None)
    assert (logits(no_bias) - want).abs().max() > 10 * 1e-4
    assert (logits(all_groups) - want).abs().max() > 10 * 1e-4


@pytest.mark.parametrize("tiny", ["deepseek_v3"], indirect=True)
@pytest.mark.parametrize(
    "change",
    [{"rope_interleave": False}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}],
    ids=["rope-rows-not-reordered", "without-yarn"],
)
def test_latent_attention_rope_counts(tiny: Any, tmp_path: Path, change: dict[str, Any]) -> None:
    """The comparison above is sensitive to DeepSeek's RoPE: read without reordering the
    interleaved pairs, or without YaRN, the logits move far past its tolerance."""
    _, directory, _ = tiny
    prompt = _prompts()[2]

    def logits(directory: Path) -> torch.Tensor:
        model: Any = load_model(directory, torch.float32, "cpu").model
        bind_fresh_caches(model, num_blocks=64, block_size=BLOCK_SIZE)
        (out,) = run_step(model, SequentialBlocks(BLOCK_SIZE), [(0, prompt, 0)], all_rows=True)
        return out

    other = tmp_path / "changed"
    shutil.copytree(directory, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, **change}))
    assert (logits(other) - logits(directory)).abs().max() > 10 * 1e-4


def test_an_unsupported_mixtral_window_is_refused(tmp_path: Path) -> None:
    config = _config("mixtral")
    config.sliding_window = 16
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(Exception, match="sliding_window"):
        load_model(tmp_path, torch.float32, "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("tiny", ["qwen3_moe"], indirect=True)  # the interpreter is slow
def test_triton_backend_matches_transformers(tiny: Any) -> None:
    """The triton backend (interpreted here): every expert's rows in one grouped launch, and
    Qwen3's per-head q/k norms."""
    _, directory, hf_model = tiny
    model: Any = load_model(directory, torch.float32, "cpu", attention_backend="triton").model
    assert model.attention_backend.name == "triton"
    bind_fresh_caches(model, num_blocks=64, block_size=BLOCK_SIZE)
    prompts, prefill_lens = _prompts()[:2], [7, 2]
    ours = prefill_then_decode_logits(model, SequentialBlocks(BLOCK_SIZE), prompts, prefill_lens)
    for got, prompt, n in zip(ours, prompts, prefill_lens, strict=True):
        torch.testing.assert_close(got, _hf_logits(hf_model, prompt)[n - 1 :], atol=1e-4, rtol=0)


def test_grouped_softmax_routing_is_refused() -> None:
    """DeepSeek-V2's group-limited routing (softmax scores) is not DeepSeek-V3's: refused, not
    served as the other."""
    with pytest.raises(ModelLoadError, match="group-limited"):
        MoEArch(num_experts=8, top_k=2, expert_intermediate_size=16, num_groups=4, topk_groups=2)
    MoEArch(8, 2, 16, routing="sigmoid_topk", num_groups=4, topk_groups=2)
