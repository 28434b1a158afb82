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
from model_test_utils import SequentialBlocks, bind_fresh_caches, prefill_then_decode_logits
from test_model_gguf_loader import HF_TO_GGUF, gguf_writer, llama_cpp_permute
from test_model_moe import _config, _hf_logits, _prompts

from deepinfer.model import load_model
from deepinfer.model.gguf_loader import GGUFTensorSource, gguf_arch, open_gguf

transformers = pytest.importorskip("transformers")

GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
MOE_TO_GGUF = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


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


def write_moe_gguf(path: Path, kind: str, hf_model: Any, experts_as: Any = None) -> None:
    """With `experts_as`, the experts' gate and up stacks in that format (rows of 64 weights;
    the down stacks' rows are too short for blocks of 32)."""
    cfg, arch = hf_model.config, GGUF_ARCH[kind]
    writer = gguf_writer(path, arch, cfg, cfg.rope_parameters["rope_theta"])
    writer.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if kind != "mixtral":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_key_length(cfg.head_dim if kind == "qwen3_moe" else 16)
        writer.add_value_length(cfg.head_dim if kind == "qwen3_moe" else 16)
    if kind == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    for name, array in _tensors(arch, hf_model).items():
        if experts_as is not None and name.endswith(("gate_exps.weight", "up_exps.weight")):
            writer.add_tensor(name, gguf.quants.quantize(array, experts_as), raw_dtype=experts_as)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(_config(request.param))
    with torch.no_grad():  # as in test_model_moe: experts and routers that matter
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.5 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(torch.randn_like(param))
            elif ".mlp." in name:
                param.copy_(0.2 * torch.randn_like(param))
            elif "embed" in name or "lm_head" in name:
                param.copy_(0.5 * torch.randn_like(param))
    hf_model.eval()
    path = tmp_path_factory.mktemp("gguf-moe") / f"{request.param}.gguf"
    write_moe_gguf(path, request.param, hf_model)
    return request.param, path, hf_model


def test_arch_from_the_metadata(tiny: Any) -> None:
    kind, path, hf_model = tiny
    arch = gguf_arch(open_gguf(path))
    assert arch.architecture == kind and arch.moe is not None
    assert arch.moe.top_k == hf_model.config.num_experts_per_tok
    assert arch.moe.dense_layers == ((1,) if kind == "qwen2_moe" else ())
    assert arch.moe.renormalize == (kind != "qwen2_moe")
    assert arch.moe.shared_intermediate_size == (40 if kind == "qwen2_moe" else 0)


def test_logits_match_transformers(tiny: Any) -> None:
    _, path, hf_model = tiny
    model = load_model(path, torch.float32, "cpu").model
    bind_fresh_caches(model, num_blocks=64, block_size=4)
    prompts, prefill_lens = _prompts(), [7, 2, 30]
    ours = prefill_then_decode_logits(model, SequentialBlocks(4), prompts, prefill_lens)
    for got, prompt, n in zip(ours, prompts, prefill_lens, strict=True):
        torch.testing.assert_close(got, _hf_logits(hf_model, prompt)[n - 1 :], atol=1e-4, rtol=0)


def test_quantized_experts_read_one_at_a_time(tiny: Any, tmp_path: Path) -> None:
    kind, _, hf_model = tiny
    path = tmp_path / "q8.gguf"
    write_moe_gguf(path, kind, hf_model, experts_as=gguf.GGMLQuantizationType.Q8_0)
    reader = open_gguf(path)
    arch = gguf_arch(reader)
    source = GGUFTensorSource(reader, arch)
    assert arch.moe is not None
    stack = next(t for t in reader.tensors if t.name == "blk.0.ffn_up_exps.weight")
    whole = gguf.quants.dequantize(stack.data, stack.tensor_type)  # [E, I, D]
    for j in range(arch.moe.num_experts):
        got = source.load(f"layers.0.mlp.experts.{j}.up_proj.weight").numpy()
        np.testing.assert_array_equal(got, whole[j])
    load_model(path, torch.float32, "cpu")  # and the whole model loads
