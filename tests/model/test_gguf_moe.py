"""Mixture-of-Experts GGUF files written as llama.cpp's converter writes them (Mixtral as `llama`
with experts and permuted Q/K rows, `qwen2moe` with its shared expert and a dense layer,
`qwen3moe`; each layer's experts stacked in one 3D tensor per projection): logits within 1e-4
of transformers on the checkpoint they were written from, and quantized experts read one expert
at a time as the whole stack dequantizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from deepinfer.model import load_model
from deepinfer.model.loading.gguf_loader import GGUFTensorSource, gguf_arch, open_gguf
from tests.model.model_test_utils import (
    SequentialBlocks,
    bind_fresh_caches,
    prefill_then_decode_logits,
)
from tests.model.test_gguf_loader import HF_TO_GGUF, gguf_writer, llama_cpp_permute
from tests.model.test_moe import COMMON, _config, _hf_logits, _prompts, randomize

transformers = pytest.importorskip("transformers")

GGUF_ARCH = {
    "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "dots1": "dots1",
    "deepseek_v3": "deepseek2",
}  # fmt: skip
MOE_TO_GGUF = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
}


def _split_kv_b(out: dict[str, np.ndarray], cfg: Any) -> None:
    """llama.cpp's absorbed form: each layer's kv_b as k_b (per head, transposed) and v_b."""
    for name in [n for n in out if n.endswith("attn_kv_b.weight")]:
        kv_b = out.pop(name).reshape(cfg.num_attention_heads, -1, cfg.kv_lora_rank)
        k_b, v_b = np.split(kv_b, [cfg.qk_nope_head_dim], axis=1)
        out[name.replace("kv_b", "k_b")] = np.ascontiguousarray(k_b.swapaxes(1, 2))
        out[name.replace("kv_b", "v_b")] = np.ascontiguousarray(v_b)


def _tensors(arch: str, hf_model: Any) -> dict[str, np.ndarray]:
    """The checkpoint under llama.cpp's names: experts as [E, rows, columns] stacks, the shared
    expert's gate as a vector, Llama's Q/K rows permuted."""
    cfg, out = hf_model.config, {}
    for name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy().copy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = array
        elif name == "model.norm.weight":
            out["output_norm.weight"] = array
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out["output.weight"] = array
        else:
            _, _, layer, rest = name.split(".", 3)
            blk = f"blk.{layer}."
            if rest == "mlp.experts.gate_up_proj":
                gate, up = np.split(array, 2, axis=1)
                out[blk + "ffn_gate_exps.weight"], out[blk + "ffn_up_exps.weight"] = gate, up
            elif rest == "mlp.experts.down_proj":
                out[blk + "ffn_down_exps.weight"] = array
            elif rest in MOE_TO_GGUF:
                out[blk + MOE_TO_GGUF[rest]] = array.reshape(-1) if "expert_gate" in rest else array
            else:
                if arch == "llama" and "q_proj" in rest:
                    array = llama_cpp_permute(array, cfg.num_attention_heads)
                elif arch == "llama" and "k_proj" in rest:
                    array = llama_cpp_permute(array, cfg.num_key_value_heads)
                out[blk + HF_TO_GGUF[rest]] = array
    return out


def write_moe_gguf(
    path: Path,
    kind: str,
    hf_model: Any,
    experts_as: Any = None,
    every_matrix: bool = False,
    split_kv_b: bool = False,
) -> None:
    """With `experts_as`, the experts' and shared expert's matrices in that format, where their
    rows are whole blocks of 32; with `every_matrix` too, every other matrix but the routers and
    the token embedding (llama.cpp keeps routers in float32)."""
    cfg, arch = hf_model.config, GGUF_ARCH[kind]
    writer = gguf_writer(path, arch, cfg, cfg.rope_parameters["rope_theta"])
    writer.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if kind != "mixtral":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if kind not in ("mixtral", "deepseek_v3"):
        writer.add_key_length(cfg.head_dim if kind in ("qwen3_moe", "dots1") else 16)
        writer.add_value_length(cfg.head_dim if kind in ("qwen3_moe", "dots1") else 16)
    if kind == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if kind == "deepseek_v3":  # as llama.cpp's converter writes DeepSeek-V3 (deepseek2)
        head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        writer.add_key_length_mla(head) if split_kv_b else writer.add_key_length(head)
        writer.add_value_length_mla(cfg.v_head_dim) if split_kv_b else writer.add_value_length(
            cfg.v_head_dim
        )
        writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
        writer.add_q_lora_rank(cfg.q_lora_rank)
        writer.add_kv_lora_rank(cfg.kv_lora_rank)
        yarn = cfg.rope_parameters
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(yarn["factor"])
        writer.add_rope_scaling_orig_ctx_len(yarn["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * yarn["mscale_all_dim"])
    if kind in ("dots1", "deepseek_v3"):  # as llama.cpp's converter writes them
        writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
        writer.add_expert_shared_count(cfg.n_shared_experts)
        writer.add_expert_weights_scale(cfg.routed_scaling_factor)
        writer.add_expert_weights_norm(cfg.norm_topk_prob)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)
    tensors = _tensors(arch, hf_model)
    if split_kv_b:
        _split_kv_b(tensors, cfg)
    for name, array in tensors.items():
        quantize = name.endswith(("gate_exps.weight", "up_exps.weight", "shexp.weight")) or (
            every_matrix
            and array.ndim == 2
            and not name.endswith(("ffn_gate_inp.weight", "token_embd.weight"))
        )
        if (
            experts_as is not None
            and (quantize or name.endswith("down_exps.weight"))
            and (array.shape[-1] % 32 == 0)
        ):
            writer.add_tensor(name, gguf.quants.quantize(array, experts_as), raw_dtype=experts_as)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(
    scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe", "dots1", "deepseek_v3"]
)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(_config(request.param))
    randomize(hf_model)
    hf_model.eval()
    path = tmp_path_factory.mktemp("gguf-moe") / f"{request.param}.gguf"
    write_moe_gguf(path, request.param, hf_model)
    return request.param, path, hf_model


def test_arch_from_the_metadata(tiny: Any) -> None:
    kind, path, hf_model = tiny
    arch = gguf_arch(open_gguf(path))
    assert arch.architecture == kind and arch.moe is not None
    assert arch.moe.top_k == hf_model.config.num_experts_per_tok
    assert arch.moe.dense_layers == {"qwen2_moe": (1,), "dots1": (0,), "deepseek_v3": (0,)}.get(
        kind, ()
    )
    assert arch.moe.renormalize == (kind != "qwen2_moe")
    if kind == "deepseek_v3":
        assert arch.mla is not None and arch.rope_yarn is not None
        assert (arch.head_dim, arch.num_kv_heads, arch.mla.q_lora_rank) == (32, 4, 64)
    if kind == "dots1":
        m = arch.moe
        assert (m.routing, m.score_bias, m.num_groups, m.topk_groups) == (
            "sigmoid_topk",
            True,
            4,
            2,
        )
        assert (m.routed_scaling, m.shared_intermediate_size, m.shared_gate) == (2.5, 48, False)
    if kind not in ("dots1", "deepseek_v3"):
        assert arch.moe.shared_intermediate_size == (40 if kind == "qwen2_moe" else 0)


def _assert_matches_transformers(path: Path, hf_model: Any) -> None:
    model = load_model(path, torch.float32, "cpu").model
    bind_fresh_caches(model, num_blocks=64, block_size=4)
    prompts, prefill_lens = _prompts(), [7, 2, 30]
    ours = prefill_then_decode_logits(model, SequentialBlocks(4), prompts, prefill_lens)
    for got, prompt, n in zip(ours, prompts, prefill_lens, strict=True):
        torch.testing.assert_close(got, _hf_logits(hf_model, prompt)[n - 1 :], atol=1e-4, rtol=0)


def test_logits_match_transformers(tiny: Any) -> None:
    _, path, hf_model = tiny
    _assert_matches_transformers(path, hf_model)


@pytest.mark.parametrize("tiny", ["deepseek_v3"], indirect=True)
def test_latent_attention_split_as_llama_cpp_absorbs_it(tiny: Any, tmp_path: Path) -> None:
    """A file whose kv_b is stored as llama.cpp's k_b and v_b gives the same logits."""
    _, _, hf_model = tiny
    path = tmp_path / "split.gguf"
    write_moe_gguf(path, "deepseek_v3", hf_model, split_kv_b=True)
    assert any(t.name == "blk.1.attn_k_b.weight" for t in open_gguf(path).tensors)
    _assert_matches_transformers(path, hf_model)


def test_quantized_experts_read_one_at_a_time(tiny: Any, tmp_path: Path) -> None:
    kind, _, hf_model = tiny
    path = tmp_path / "q8.gguf"
    write_moe_gguf(path, kind, hf_model, experts_as=gguf.GGMLQuantizationType.Q8_0)
    reader = open_gguf(path)
    arch = gguf_arch(reader)
    source = GGUFTensorSource(reader, arch)
    assert arch.moe is not None
    stack = next(t for t in reader.tensors if t.name == "blk.2.ffn_up_exps.weight")
    whole = gguf.quants.dequantize(stack.data, stack.tensor_type)  # [E, I, D]
    for j in range(arch.moe.num_experts):
        got = source.load(f"layers.2.mlp.experts.{j}.up_proj.weight").numpy()
        np.testing.assert_array_equal(got, whole[j])
    load_model(path, torch.float32, "cpu")  # and the whole model loads


def test_quantized_experts_served_in_their_blocks(tmp_path: Path) -> None:
    """Q8_0 experts (and shared expert) multiplied by the native kernel in their blocks: the
    float32-activation kernel gives the logits of the same values dequantized, within float
    rounding; the fp32 stacks are gone."""
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        **{**COMMON, "hidden_size": 64}, intermediate_size=64, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=64,
        norm_topk_prob=False, tie_word_embeddings=False,
    )  # fmt: skip
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if ".mlp." in name:
                param.copy_(0.2 * torch.randn_like(param))
    path = tmp_path / "q8-experts.gguf"
    write_moe_gguf(path, "qwen2_moe", hf_model, experts_as=gguf.GGMLQuantizationType.Q8_0)
    served = load_model(path, torch.float32, "cpu", quantized_matmul="on")
    plain = load_model(path, torch.float32, "cpu", quantized_matmul="off")
    int8 = load_model(path, torch.float32, "cpu", matmul_activations="int8")
    block: Any = served.model.layers[0].mlp
    assert block.quantized is not None and block.w_gate_up is None
    assert block.shared.gate_up_proj.quantized is not None
    assert served.quantized_bytes > 0
    prompts, prefill_lens = _prompts(), [7, 2, 30]
    logits = []
    for loaded in (served, plain, int8):
        bind_fresh_caches(loaded.model, num_blocks=64, block_size=4)
        logits.append(
            prefill_then_decode_logits(loaded.model, SequentialBlocks(4), prompts, prefill_lens)
        )
    for got, want, _ in zip(*logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # int8 activations (the CPU default for GGUF files) round each row to 8 bits: the experts
    # err as much as a dense FFN (the shared expert) does on the same rows, about 1%
    h = torch.randn(20, config.hidden_size, generator=torch.Generator().manual_seed(2))
    ops = plain.model.attention_backend
    exact, rounded = plain.model.layers[0].mlp, int8.model.layers[0].mlp
    with torch.inference_mode():
        moe_error = _relative_error(rounded(h, ops), exact(h, ops))
        dense_error = _relative_error(rounded.shared(h, ops), exact.shared(h, ops))
    assert moe_error < 2 * dense_error < 0.05


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().mean() / want.abs().mean())


@pytest.mark.parametrize("tiny", ["deepseek_v3"], indirect=True)
def test_latent_attention_served_in_blocks(tiny: Any, tmp_path: Path) -> None:
    """Every matrix of a DeepSeek-V3 in Q8_0 (the latent projections too, their rotary rows
    reordered in blocks): the logits of the same values dequantized, within float rounding."""
    _, _, hf_model = tiny
    path = tmp_path / "q8.gguf"
    write_moe_gguf(path, "deepseek_v3", hf_model, gguf.GGMLQuantizationType.Q8_0, every_matrix=True)
    served = load_model(path, torch.float32, "cpu", quantized_matmul="on")
    plain = load_model(path, torch.float32, "cpu", quantized_matmul="off")
    attn: Any = served.model.layers[1].self_attn
    assert all(
        getattr(attn, name).quantized is not None
        for name in ("q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj")
    )
    prompts, prefill_lens = _prompts(), [7, 2, 30]
    logits = []
    for loaded in (served, plain):
        bind_fresh_caches(loaded.model, num_blocks=64, block_size=4)
        logits.append(
            prefill_then_decode_logits(loaded.model, SequentialBlocks(4), prompts, prefill_lens)
        )
    for got, want in zip(*logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
