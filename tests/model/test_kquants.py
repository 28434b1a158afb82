"""Serving GGUF K-quant matrices (Q4_K, Q5_K, Q6_K) in their blocks: a tiny Llama written here
with K-quant superblocks (random bytes; transformers runs on gguf-py's dequantization of them),
and real tensors of a Q4_K_M file (Q4_K, Q6_K, Q5_0 and Q8_0 matrices) against gguf-py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from deepinfer.kernels.linear.int8_matmul import int8_linear, int8_linear_reference, pack_int8
from deepinfer.kernels.linear.quant_matmul import (
    QuantFormat,
    QuantizedWeight,
    dequantize,
    dequantize_reference,
    quant_linear,
)
from deepinfer.model import load_model
from deepinfer.model.loading.gguf_loader import open_gguf
from deepinfer.model.loading.gguf_repack import q5_0_as_q8_0
from tests.model.test_gguf_loader import CONFIG as BASE_CONFIG
from tests.model.test_gguf_loader import HF_TO_GGUF, gguf_writer, llama_cpp_permute
from tests.model.test_native_stack import _counting, _steps
from tests.model.test_quantized import _logits, _reference, needs_native

transformers = pytest.importorskip("transformers")

# every matrix's width a whole number of 256-weight superblocks: hidden, heads x head size (4 x
# 64) and intermediate
CONFIG = {**BASE_CONFIG, "vocab_size": 67, "hidden_size": 256, "intermediate_size": 512}
Q4_K, Q5_K, Q6_K = (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K,
                    gguf.GGMLQuantizationType.Q6_K)  # fmt: skip
FORMATS = {
    "q_proj": Q4_K, "k_proj": Q4_K, "v_proj": Q4_K, "o_proj": Q6_K, "gate_proj": Q5_K,
    "up_proj": Q5_K, "down_proj": Q6_K, "embed_tokens": Q6_K, "lm_head": Q4_K,
}  # fmt: skip
D = {Q4_K: 2e-4, Q5_K: 1e-4, Q6_K: 5e-5}
"""A d (and dmin) giving weights of a few hundredths from random scales and quants."""
FP16_FIELDS = {Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,)}


def kquant_matrix(
    qtype: gguf.GGMLQuantizationType, shape: tuple[int, int], rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Random superblocks of a [rows, cols] matrix (every byte random but d and dmin), and
    gguf-py's dequantization of them."""
    rows, cols = shape
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        d = (D[qtype] * rng.uniform(0.5, 1.0, raw.shape[:2])).astype(np.float16)
        raw[..., at : at + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    blocks = raw.reshape(rows, -1)
    return blocks, gguf.quants.dequantize(blocks, qtype).astype(np.float32)


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[rest]}"


def write_kquant_gguf(path: Path, hf_model: Any) -> None:
    """Every matrix in its FORMATS type; the HF model gets the dequantized values."""
    cfg = hf_model.config
    writer = gguf_writer(path, "llama", cfg, CONFIG["rope_theta"])
    rng = np.random.default_rng(0)
    for name, tensor in hf_model.state_dict().items():
        if name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", tensor.float().numpy().copy())
            continue
        if name.endswith("norm.weight"):
            writer.add_tensor(_gguf_name(name), tensor.float().numpy().copy())
            continue
        qtype = FORMATS[name.split(".")[-2]]
        blocks, dequantized = kquant_matrix(qtype, tuple(tensor.shape), rng)
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(dequantized))
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
        for proj, n in heads.items():
            if proj in name:  # whole rows of blocks move, as whole rows of weights would
                blocks = llama_cpp_permute(blocks, n)
        writer.add_tensor(_gguf_name(name), blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    torch.manual_seed(8)
    config = transformers.LlamaConfig(**CONFIG, tie_word_embeddings=False)
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp("kgguf") / "tiny-k.gguf"
    write_kquant_gguf(path, hf_model)
    return path, hf_model


@needs_native
def test_k_quant_matrices_match_transformers(kquant_gguf: Any) -> None:
    path, hf_model = kquant_gguf
    loaded = load_model(path, torch.float32, "cpu", quantized_matmul="on")
    model: Any = loaded.model
    assert model.lm_head_quantized.fmt is QuantFormat.Q4_K
    layer = model.layers[0]
    served = {
        "qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
        "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj,
    }  # fmt: skip
    formats = {name: linear.quantized.fmt for name, linear in served.items()}
    assert formats == {"qkv": QuantFormat.Q4_K, "o": QuantFormat.Q6_K,
                       "gate_up": QuantFormat.Q5_K, "down": QuantFormat.Q6_K}  # fmt: skip
    prompt, want = _reference(hf_model)
    torch.testing.assert_close(_logits(model, prompt), want, atol=1e-4, rtol=0)


@needs_native
def test_k_quants_with_int8_activations_stay_close(kquant_gguf: Any) -> None:
    path, hf_model = kquant_gguf
    loaded = load_model(path, torch.float32, "cpu", matmul_activations="int8")
    assert loaded.int8_activations and loaded.quantized_bytes > 0
    prompt, want = _reference(hf_model)
    error = (_logits(loaded.model, prompt) - want).abs()
    assert 0 < error.max().item() < 0.05 * want.abs().max().item()


@needs_native
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_native_stack_serves_k_quants_bit_for_bit(
    kquant_gguf: Any, activations: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = kquant_gguf
    model = load_model(path, torch.float32, "cpu", matmul_activations=activations).model
    layered, layered_kv = _steps(model, native=False)
    calls = _counting(monkeypatch)
    stacked, stacked_kv = _steps(model, native=True)
    assert calls[0] == 6, "every step of this test is all native rows"
    for a, b in zip(layered + layered_kv, stacked + stacked_kv, strict=True):
        assert torch.equal(a, b)


GEMMA3_Q4_K_M = Path.home() / ".cache/deepinfer/models/gemma3-270m/gemma-3-270m-q4_k_m.gguf"
REAL_TENSORS = (
    "blk.0.attn_output.weight",  # Q4_K
    "blk.2.ffn_down.weight",  # Q4_K
    "blk.0.ffn_down.weight",  # Q6_K
    "blk.0.attn_q.weight",  # Q5_0, served as Q8_0
    "blk.0.attn_v.weight",  # Q8_0
)


def _real_weight(tensor: Any) -> QuantizedWeight:
    """A file's matrix as the loader serves it (Q5_0 repacked as Q8_0)."""
    data, kind, k = np.asarray(tensor.data), tensor.tensor_type.name, int(tensor.shape[0])
    if kind == "Q5_0":
        return QuantizedWeight(QuantFormat.Q8_0, torch.from_numpy(q5_0_as_q8_0(data)), k)
    return QuantizedWeight(QuantFormat[kind], torch.from_numpy(np.array(data)), k)


@needs_native
@pytest.mark.skipif(not GEMMA3_Q4_K_M.exists(), reason="no gemma-3-270m Q4_K_M file here")
def test_real_k_quant_tensors_are_gguf_py_values() -> None:
    tensors = {t.name: t for t in open_gguf(GEMMA3_Q4_K_M).tensors}
    kinds = {tensors[n].tensor_type.name for n in REAL_TENSORS}
    assert kinds == {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    for name in REAL_TENSORS:
        t = tensors[name]
        w = _real_weight(t)
        dense = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        want = torch.from_numpy(dense)
        assert torch.equal(dequantize_reference(w), want), name
        assert torch.equal(dequantize(w), want), name
        x = torch.randn(3, w.in_features, generator=torch.Generator().manual_seed(0))
        got = quant_linear(x, w)
        exact = x.double() @ want.double().t()
        torch.testing.assert_close(got.double(), exact, atol=1e-4, rtol=1e-4)
        assert torch.equal(quant_linear(x[1:2], w), got[1:2])
        int8 = int8_linear(x, pack_int8(w))
        torch.testing.assert_close(int8, int8_linear_reference(x, w), atol=1e-5, rtol=1e-5)
        assert (int8 - got).abs().max() < 0.05 * got.abs().max()
