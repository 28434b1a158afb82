"""GGUF loading on tiny files written here: names, Q/K un-permutation, metadata, and errors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from deepinfer.environment import default_model_path
from deepinfer.errors import ModelLoadError
from deepinfer.model import load_model, model_fingerprint
from deepinfer.model.loading.gguf_loader import (
    GGUFTensorSource,
    Reader,
    canonical_name,
    gguf_arch,
    open_gguf,
    unpermute_qk,
)
from tests.model.model_test_utils import SequentialBlocks, bind_fresh_caches, run_step

transformers = pytest.importorskip("transformers")

HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
CONFIG = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=5000.0,
)


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama Q/K rows (for interleaved RoPE)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_writer(path: Path, arch: str, cfg: Any, rope_theta: float) -> gguf.GGUFWriter:
    """A writer with the architecture metadata of a transformers config."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta)
    return writer


def add_layer_tensor(
    writer: gguf.GGUFWriter,
    name: str,
    array: np.ndarray,
    matrices: gguf.GGMLQuantizationType | None,
) -> None:
    """A layer's tensor: float32, or a matrix in `matrices`' blocks where that is given."""
    if matrices is None or array.ndim != 2:
        writer.add_tensor(name, array)
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, matrices), raw_dtype=matrices)


def write_gguf(
    path: Path,
    arch: str,
    hf_model: Any,
    tie: bool,
    matrices: gguf.GGMLQuantizationType | None = None,
    formats: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> None:
    """The layers' matrices in float32, or in `matrices`' blocks, or in the blocks `formats`
    names for their GGUF name's ending (`attn_v.weight`: a Q4_K_M file's mixed layers)."""
    cfg = hf_model.config
    writer = gguf_writer(path, arch, cfg, CONFIG["rope_theta"])
    for name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy().copy()
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", array)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", array)
        elif name == "lm_head.weight":
            if not tie:
                writer.add_tensor("output.weight", array)
        else:
            _, _, layer, rest = name.split(".", 3)
            if arch == "llama" and "q_proj" in rest:
                array = llama_cpp_permute(array, cfg.num_attention_heads)
            elif arch == "llama" and "k_proj" in rest:
                array = llama_cpp_permute(array, cfg.num_key_value_heads)
            ours = HF_TO_GGUF[rest]
            kind = (formats or {}).get(ours, matrices)
            add_layer_tensor(writer, f"blk.{layer}.{ours}", array, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=[("llama", False), ("llama", True), ("qwen2", True)])
def tiny_gguf(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any]:
    arch, tie = request.param
    torch.manual_seed(3)
    config_class = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    hf_model = transformers.AutoModelForCausalLM.from_config(
        config_class(**CONFIG, tie_word_embeddings=tie)
    ).eval()
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{arch}.gguf"
    write_gguf(path, arch, hf_model, tie)
    return path, hf_model


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(8 * 6 * 3, dtype=np.float32).reshape(48, 3)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(w, 4), 4), w)


def test_tiny_gguf_matches_transformers(tiny_gguf: Any) -> None:
    path, hf_model = tiny_gguf
    loaded = load_model(path, torch.float32, "cpu")
    assert loaded.gguf_reader is not None
    assert loaded.arch.tie_word_embeddings == hf_model.config.tie_word_embeddings
    assert loaded.arch.qkv_bias == (hf_model.config.model_type == "qwen2")
    bind_fresh_caches(loaded.model, num_blocks=32, block_size=4)
    prompt = torch.randint(0, 61, (19,), generator=torch.Generator().manual_seed(0)).tolist()
    (got,) = run_step(loaded.model, SequentialBlocks(4), [(0, prompt, 0)], all_rows=True)
    with torch.no_grad():
        want = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_fingerprint_stable_and_sensitive(tiny_gguf: Any, tmp_path: Path) -> None:
    path, _ = tiny_gguf
    a = load_model(path, torch.float32, "cpu")
    b = load_model(path, torch.float32, "cpu")
    fp = model_fingerprint(a, torch.float32, 16)
    assert len(fp) == 64 and fp == model_fingerprint(b, torch.float32, 16)
    assert fp != model_fingerprint(a, torch.bfloat16, 16)
    assert fp != model_fingerprint(a, torch.float32, 32)
    changed = tmp_path / "changed.gguf"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # one weight byte differs
    changed.write_bytes(bytes(data))
    assert model_fingerprint(load_model(changed, torch.float32, "cpu"), torch.float32, 16) != fp


def test_a_file_is_parsed_once_until_it_changes(tiny_gguf: Any, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    data = bytearray(tiny_gguf[0].read_bytes())
    path.write_bytes(bytes(data))
    first = open_gguf(path)
    assert open_gguf(path) is first  # a second engine on the file reuses the parsed reader
    data[-3] ^= 0xFF  # rewritten in place, same size: another identity, parsed anew
    path.write_bytes(bytes(data))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert open_gguf(path) is not first
    path.write_bytes(bytes(data[: len(data) // 2]))  # truncated in place: refused, not cached
    with pytest.raises(ModelLoadError, match=r"truncated|corrupt"):
        open_gguf(path)


@pytest.mark.slow
def test_the_reader_parses_every_field_as_gguf_py_does() -> None:
    """Our reader's one-loop arrays (the vocabulary, merges, token types) against gguf-py's own
    per-entry parse of the real model: the same fields, parts, dtypes, contents and tensors."""
    ours, theirs = Reader(default_model_path()), gguf.GGUFReader(default_model_path())
    assert list(ours.fields) == list(theirs.fields)
    for name, want in theirs.fields.items():
        got = ours.fields[name]
        assert (got.offset, got.types, got.data) == (want.offset, want.types, want.data), name
        assert len(got.parts) == len(want.parts), name
        for a, b in zip(got.parts, want.parts, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        assert got.contents() == want.contents(), name
    assert [(t.name, t.data_offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.data_offset, t.n_bytes) for t in theirs.tensors
    ]
    assert len(ours.fields["tokenizer.ggml.tokens"].contents()) == 49152


@pytest.mark.slow
def test_block_matrices_load_as_gguf_py_dequantizes_them() -> None:
    """The loader dequantizes Q4_1/Q8_0 matrices with the native kernel: bit for bit what
    gguf-py gives, for every such matrix of the real model (rows unpermuted alike)."""
    reader = open_gguf(default_model_path())
    source = GGUFTensorSource(reader, gguf_arch(reader))
    checked = 0
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in ("Q4_1", "Q8_0"):
            continue
        name = canonical_name(tensor.name)
        want = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        want = source._unpermuted(name, want)
        assert torch.equal(source.load(name), torch.from_numpy(np.ascontiguousarray(want))), name
        checked += 1
    assert checked == 211


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope.gguf", torch.float32, "cpu")


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 definitely a zip file")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(path, torch.float32, "cpu")


@pytest.mark.parametrize("keep_fraction", [0.02, 0.5, 0.999])
def test_truncated_gguf(tiny_gguf: Any, tmp_path: Path, keep_fraction: float) -> None:
    path, _ = tiny_gguf
    data = path.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: max(8, int(len(data) * keep_fraction))])
    with pytest.raises(ModelLoadError, match=r"truncated|corrupt"):
        load_model(truncated, torch.float32, "cpu")


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ModelLoadError, match=r"'gpt2'.*llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe"
    ):
        load_model(path, torch.float32, "cpu")


def test_unsupported_hf_architecture_and_bad_dirs(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path, torch.float32, "cpu")
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(
        ModelLoadError, match=r"'mamba'.*llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe"
    ):
        load_model(tmp_path, torch.float32, "cpu")
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(tmp_path, torch.float32, "cpu")


GEMMA3_TO_GGUF = {
    **HF_TO_GGUF,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def write_gemma3_gguf(
    path: Path,
    hf_model: Any,
    pattern: int | list[bool] | None,
    matrices: gguf.GGMLQuantizationType | None = None,
) -> None:
    """As llama.cpp's converter writes Gemma 3: norms stored as 1 + w, no Q/K permutation,
    the window in the metadata (the layer pattern only when given); the layers' matrices in
    float32, or in `matrices`' blocks."""
    cfg = hf_model.config
    writer = gguf_writer(path, "gemma3", cfg, 1e6)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    if isinstance(pattern, int):
        writer.add_uint32("gemma3.attention.sliding_window_pattern", pattern)
    elif pattern is not None:
        writer.add_array("gemma3.attention.sliding_window_pattern", pattern)
    for name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy().copy()
        if name.endswith("norm.weight"):
            array = array + 1.0
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", array)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", array)
        elif name != "lm_head.weight":
            _, _, layer, rest = name.split(".", 3)
            add_layer_tensor(writer, f"blk.{layer}.{GEMMA3_TO_GGUF[rest]}", array, matrices)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("pattern", "windowed"),
    [
        (None, [True] * 5 + [False] + [True]),  # the file silent: every 6th layer full
        (3, [True, True, False] * 2 + [True]),
        ([True, False] * 3 + [False], [True, False] * 3 + [False]),
    ],
)
def test_tiny_gemma3_gguf_matches_transformers(
    pattern: Any, windowed: list[bool], tmp_path: Path
) -> None:
    """Windows of 6 keys over a 29-token prompt; the local layers' RoPE base where the file
    is silent (10000)."""
    torch.manual_seed(5)
    types = ["sliding_attention" if w else "full_attention" for w in windowed]
    config = transformers.Gemma3TextConfig(
        **{**CONFIG, "num_hidden_layers": 7}, head_dim=16, sliding_window=6, layer_types=types,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
        query_pre_attn_scalar=16,
    )  # fmt: skip
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random norms, so that a missed one (or a missed + 1) shows
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.copy_(0.5 * torch.randn_like(param))
    path = tmp_path / "tiny-gemma3.gguf"
    write_gemma3_gguf(path, hf_model, pattern)
    loaded = load_model(path, torch.float32, "cpu")
    assert loaded.arch.layer_windows == tuple(6 if w else 0 for w in windowed)
    assert loaded.arch.rope_local_theta == 10000.0 and loaded.arch.attention_scale == 0.25
    bind_fresh_caches(loaded.model, num_blocks=32, block_size=4)
    prompt = torch.randint(0, 61, (29,), generator=torch.Generator().manual_seed(0)).tolist()
    (got,) = run_step(loaded.model, SequentialBlocks(4), [(0, prompt, 0)], all_rows=True)
    with torch.no_grad():
        want = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_gemma3_names_its_four_norms() -> None:
    assert canonical_name("blk.3.ffn_norm.weight") == "layers.3.post_attention_layernorm.weight"
    assert canonical_name("blk.3.ffn_norm.weight", "gemma3") == (
        "layers.3.pre_feedforward_layernorm.weight"
    )
    assert canonical_name("blk.3.post_ffw_norm.weight", "gemma3") == (
        "layers.3.post_feedforward_layernorm.weight"
    )
    assert canonical_name("blk.3.post_attention_norm.weight", "gemma3") == (
        "layers.3.post_attention_layernorm.weight"
    )
