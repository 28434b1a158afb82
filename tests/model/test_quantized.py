"""Serving a GGUF file's Q4_1/Q8_0 matrices (and Q4_0, Q5_0 repacked) in their blocks (native
kernel) on a tiny model written here: logits match transformers run on gguf-py's dequantization
of the same file."""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from deepinfer.args import add_engine_args, config_from_args
from deepinfer.config import Config, ModelConfig
from deepinfer.errors import ConfigError, ModelLoadError
from deepinfer.kernels.linear.int8_matmul import Int8PackedWeight
from deepinfer.kernels.linear.quant_matmul import (
    QuantFormat,
    QuantizedWeight,
    dequantize,
    dequantize_reference,
)
from deepinfer.kernels.native.cpu_native import native_available
from deepinfer.model import load_model, model_fingerprint
from deepinfer.model.llama_layers import QuantizedEmbedding
from deepinfer.model.loading.gguf_loader import GGUFTensorSource
from deepinfer.model.loading.gguf_repack import q4_0_as_q4_1, q5_0_as_q8_0, q5_0_as_q8_0_numpy
from tests.model.model_test_utils import SequentialBlocks, bind_fresh_caches, run_step
from tests.model.test_gguf_loader import CONFIG as BASE_CONFIG
from tests.model.test_gguf_loader import HF_TO_GGUF, gguf_writer, llama_cpp_permute, write_gguf

transformers = pytest.importorskip("transformers")
needs_native = pytest.mark.skipif(not native_available(), reason="no native CPU kernels here")

# rows of whole 32-weight blocks: every matrix's width is a multiple of 32
CONFIG = {**BASE_CONFIG, "vocab_size": 67, "hidden_size": 64, "intermediate_size": 96}
Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
Q4_0, Q5_0 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q5_0
Q5_1 = gguf.GGMLQuantizationType.Q5_1


def _quantized(
    array: np.ndarray, qtype: gguf.GGMLQuantizationType
) -> tuple[np.ndarray, np.ndarray]:
    blocks = gguf.quants.quantize(array, qtype)
    return blocks, gguf.quants.dequantize(blocks, qtype).astype(np.float32)


def write_quantized_gguf(
    path: Path, hf_model: Any, tie: bool, matrices: gguf.GGMLQuantizationType = Q4_1
) -> None:
    """Matrices in `matrices` (Q4_1), the embedding in Q8_0; the HF model gets the dequantized
    values."""
    cfg = hf_model.config
    writer = gguf_writer(path, "llama", cfg, CONFIG["rope_theta"])
    state = hf_model.state_dict()
    for name, tensor in state.items():
        array = tensor.float().numpy().copy()
        if name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", array)
            continue
        if name == "lm_head.weight" and tie:
            continue
        if name.endswith("norm.weight"):
            _, _, layer, rest = name.split(".", 3)
            writer.add_tensor(f"blk.{layer}.{HF_TO_GGUF[rest]}", array)
            continue
        qtype = Q8_0 if name == "model.embed_tokens.weight" else matrices
        blocks, dequantized = _quantized(array, qtype)
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(dequantized))
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{HF_TO_GGUF[rest]}"
            heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
            for proj, n in heads.items():
                if proj in rest:  # whole rows of blocks move, as whole rows of weights would
                    blocks = llama_cpp_permute(blocks, n)
        writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "separate-head"])
def quantized_gguf(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any]:
    torch.manual_seed(5)
    hf_model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**CONFIG, tie_word_embeddings=request.param)
    ).eval()
    path = tmp_path_factory.mktemp("qgguf") / "tiny-q.gguf"
    write_quantized_gguf(path, hf_model, request.param)
    return path, hf_model


def _logits(model: Any, prompt: list[int]) -> torch.Tensor:
    bind_fresh_caches(model, num_blocks=32, block_size=4)
    (got,) = run_step(model, SequentialBlocks(4), [(0, prompt, 0)], all_rows=True)
    return got


def _reference(hf_model: Any) -> tuple[list[int], torch.Tensor]:
    """A fixed prompt and transformers' logits for it (the dequantized weights)."""
    prompt = torch.randint(0, 67, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        return prompt, hf_model(torch.tensor([prompt])).logits[0]


@needs_native
@pytest.mark.parametrize("int8", [False, True])
def test_embedding_is_looked_up_from_its_blocks(quantized_gguf: Any, int8: bool) -> None:
    """The token table stays in its GGUF blocks (no fp32 copy): every id's row is gguf-py's
    dequantized row, in any shape of ids; a tied head not repacked shares the same blocks."""
    path, _ = quantized_gguf
    loaded = load_model(
        path, torch.float32, "cpu", quantized_matmul="on",
        matmul_activations="int8" if int8 else "float32",
    )  # fmt: skip
    model: Any = loaded.model
    embed = model.embed_tokens
    assert isinstance(embed, QuantizedEmbedding) and not list(embed.parameters())
    reader = gguf.GGUFReader(path)
    (tensor,) = [t for t in reader.tensors if t.name == "token_embd.weight"]
    table = torch.from_numpy(
        gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32)
    )  # [V, hidden]
    ids = torch.tensor([[5, 0, 66, 5], [1, 2, 3, 65]])
    assert torch.equal(model.embed(ids), table[ids])
    assert torch.equal(model.embed(ids[0, :0]), table[:0])
    if loaded.arch.tie_word_embeddings and not int8:
        assert model.lm_head_quantized is embed.blocks


@needs_native
def test_served_matrices_are_never_dequantized(
    quantized_gguf: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading dequantizes only what is served in float (the norms here): no fp32 copy of a
    matrix served from its blocks is ever made, so loading peaks near the blocks' size."""
    path, _ = quantized_gguf
    loaded_names: list[str] = []
    original = GGUFTensorSource.load

    def spy(self: GGUFTensorSource, name: str) -> torch.Tensor:
        loaded_names.append(name)
        return original(self, name)

    monkeypatch.setattr(GGUFTensorSource, "load", spy)
    load_model(path, torch.float32, "cpu", quantized_matmul="on")
    assert loaded_names and all(name.endswith("norm.weight") for name in loaded_names)
    loaded_names.clear()
    load_model(path, torch.float32, "cpu", quantized_matmul="off")
    assert any(name.endswith("proj.weight") for name in loaded_names)


@needs_native
def test_quantized_matmul_matches_transformers(quantized_gguf: Any) -> None:
    path, hf_model = quantized_gguf
    loaded = load_model(path, torch.float32, "cpu", quantized_matmul="on")
    assert loaded.quantized_bytes > 0 and not loaded.int8_activations  # float32 by default
    assert loaded.model.lm_head_quantized is not None  # type: ignore[attr-defined]
    prompt, want = _reference(hf_model)
    got = _logits(loaded.model, prompt)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    plain = load_model(path, torch.float32, "cpu", quantized_matmul="off")
    assert plain.quantized_bytes == 0
    torch.testing.assert_close(_logits(plain.model, prompt), got, atol=1e-4, rtol=0)
    # KV computed by one is not served to the other
    assert model_fingerprint(loaded, torch.float32, 16) != model_fingerprint(
        plain, torch.float32, 16
    )


def test_q4_0_blocks_are_q4_1_blocks_of_the_same_values() -> None:
    """Repacked, a Q4_0 matrix dequantizes to gguf-py's values bit for bit (fp16 scales from
    the smallest subnormal range to the largest that -8 d allows); past that, it is left to the
    dequantizing path."""
    rng = np.random.default_rng(0)
    magnitudes = np.array([1e-9, 1e-6, 1e-3, 1.0, 30.0, 1e3, 2e3])[:, None]
    x = (rng.standard_normal((7, 96)) * magnitudes).astype(np.float32)
    blocks = gguf.quants.quantize(x, Q4_0)
    repacked = q4_0_as_q4_1(blocks)
    assert repacked is not None
    w = QuantizedWeight(QuantFormat.Q4_1, torch.from_numpy(repacked), 96)
    want = torch.from_numpy(gguf.quants.dequantize(blocks, Q4_0).astype(np.float32))
    assert torch.equal(dequantize_reference(w), want)
    if native_available():
        assert torch.equal(dequantize(w), want)
    big = np.full((1, 32), 1e5, dtype=np.float32)  # d = -12500: -8 d is past fp16's range
    assert q4_0_as_q4_1(gguf.quants.quantize(big, Q4_0)) is None


@needs_native
def test_q4_0_matrices_served_as_q4_1(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(6)
    config = transformers.LlamaConfig(**CONFIG, tie_word_embeddings=True)
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    write_quantized_gguf(tmp_path / "q4_0.gguf", hf_model, tie=True, matrices=Q4_0)
    loaded = load_model(tmp_path / "q4_0.gguf", torch.float32, "cpu", quantized_matmul="on")
    assert loaded.quantized_bytes > 0
    prompt, want = _reference(hf_model)
    torch.testing.assert_close(_logits(loaded.model, prompt), want, atol=1e-4, rtol=0)
    # a format the kernel does not take: dequantized, with one line saying so
    write_quantized_gguf(tmp_path / "q5_1.gguf", hf_model, tie=True, matrices=Q5_1)
    with caplog.at_level(logging.INFO, logger="deepinfer.model.loading.quantized"):
        loaded = load_model(tmp_path / "q5_1.gguf", torch.float32, "cpu", quantized_matmul="on")
    lines = [r.getMessage() for r in caplog.records if "dequantized to float32" in r.getMessage()]
    assert lines == ["matrices dequantized to float32 (the quantized matmul takes Q4_0, Q4_1, "
                     "Q5_0, Q8_0, Q4_K, Q5_K, Q6_K): "
                     f"{7 * CONFIG['num_hidden_layers']} in Q5_1"]  # fmt: skip
    prompt, want = _reference(hf_model)
    torch.testing.assert_close(_logits(loaded.model, prompt), want, atol=1e-4, rtol=0)


def test_q5_0_blocks_are_q8_0_blocks_of_the_same_values() -> None:
    """Repacked, a Q5_0 matrix dequantizes to gguf-py's values bit for bit: blocks gguf-py
    wrote (scales from subnormal to large), and blocks of every byte value."""
    rng = np.random.default_rng(0)
    magnitudes = np.array([1e-9, 1e-6, 1e-3, 1.0, 30.0, 1e3, 6e4])[:, None]
    x = (rng.standard_normal((7, 96)) * magnitudes).astype(np.float32)
    written = gguf.quants.quantize(x, Q5_0)
    raw = rng.integers(0, 256, (5, 3, 22), dtype=np.uint8)
    raw[..., :2] = rng.standard_normal((5, 3)).astype(np.float16).view(np.uint8).reshape(5, 3, 2)
    for blocks in (written, raw.reshape(5, -1)):
        for repack in (q5_0_as_q8_0, q5_0_as_q8_0_numpy):  # the native one where it runs
            w = QuantizedWeight(QuantFormat.Q8_0, torch.from_numpy(repack(blocks)), 96)
            want = torch.from_numpy(gguf.quants.dequantize(blocks, Q5_0).astype(np.float32))
            assert torch.equal(dequantize_reference(w), want)
            if native_available():
                assert torch.equal(dequantize(w), want)
        assert np.array_equal(q5_0_as_q8_0(blocks), q5_0_as_q8_0_numpy(blocks))


@needs_native
def test_q5_0_matrices_served_as_q8_0(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(7)
    config = transformers.LlamaConfig(**CONFIG, tie_word_embeddings=False)
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    write_quantized_gguf(tmp_path / "q5_0.gguf", hf_model, tie=False, matrices=Q5_0)
    with caplog.at_level(logging.INFO, logger="deepinfer.model.loading.quantized"):
        loaded = load_model(tmp_path / "q5_0.gguf", torch.float32, "cpu", quantized_matmul="on")
    assert not [r for r in caplog.records if "dequantized to float32" in r.getMessage()]
    assert loaded.model.lm_head_quantized.fmt is QuantFormat.Q8_0  # type: ignore[attr-defined]
    prompt, want = _reference(hf_model)
    torch.testing.assert_close(_logits(loaded.model, prompt), want, atol=1e-4, rtol=0)


def test_on_refuses_where_the_kernel_cannot_run(quantized_gguf: Any) -> None:
    path, _ = quantized_gguf
    with pytest.raises(ModelLoadError, match="quantized-matmul on"):
        load_model(path, torch.bfloat16, "cpu", quantized_matmul="on")
    assert load_model(path, torch.bfloat16, "cpu").quantized_bytes == 0  # auto: fp weights


@needs_native
def test_int8_activations_stay_close_to_transformers(quantized_gguf: Any) -> None:
    """Activations rounded to int8 blocks; transformers is the oracle, the exact path the peer."""
    path, hf_model = quantized_gguf
    loaded = load_model(path, torch.float32, "cpu", matmul_activations="int8")
    exact = load_model(path, torch.float32, "cpu")
    assert loaded.int8_activations and loaded.quantized_bytes > 0
    assert isinstance(loaded.model.lm_head_quantized, Int8PackedWeight)  # type: ignore[attr-defined]
    prompt, want = _reference(hf_model)
    got = _logits(loaded.model, prompt)
    error = (got - want).abs()
    assert 0 < error.max().item() < 0.05 * want.abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.9
    assert model_fingerprint(loaded, torch.float32, 16) != model_fingerprint(
        exact, torch.float32, 16
    )


def test_int8_activations_need_the_quantized_kernel(quantized_gguf: Any) -> None:
    path, _ = quantized_gguf
    with pytest.raises(ModelLoadError, match="matmul-activations int8"):
        load_model(path, torch.bfloat16, "cpu", matmul_activations="int8")
    with pytest.raises(ModelLoadError, match="matmul-activations int8"):
        load_model(path, torch.float32, "cpu", quantized_matmul="off", matmul_activations="int8")
    with pytest.raises(ModelLoadError, match="unknown matmul activations"):
        load_model(path, torch.float32, "cpu", matmul_activations="int4")


@needs_native
def test_int8_activations_need_quantized_matrices(tmp_path: Path) -> None:
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG))
    write_gguf(tmp_path / "f32.gguf", "llama", hf_model, tie=False)  # float32 matrices only
    with pytest.raises(ModelLoadError, match="no matrices in a format the quantized matmul"):
        load_model(tmp_path / "f32.gguf", torch.float32, "cpu", matmul_activations="int8")


def test_matmul_activations_flag_maps_to_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).model.matmul_activations == "auto"
    ns = parser.parse_args(["--matmul-activations", "auto"])
    assert config_from_args(ns).model.matmul_activations == "auto"
    ns = parser.parse_args(["--matmul-activations", "int8"])
    assert config_from_args(ns).model.matmul_activations == "int8"
    ns = parser.parse_args(["--matmul-activations", "float32"])
    assert config_from_args(ns).model.matmul_activations == "float32"
    with pytest.raises(ConfigError, match="auto, float32 or int8"):
        Config(model=ModelConfig(matmul_activations="int4"))  # type: ignore[arg-type]


def test_auto_activations_are_int8_exactly_where_the_quantized_kernel_serves() -> None:
    from deepinfer.model.loading.quantized import int8_activations_wanted

    assert int8_activations_wanted("auto", quantized=True)
    assert not int8_activations_wanted("auto", quantized=False)  # safetensors, GPU: float32
    assert not int8_activations_wanted("float32", quantized=True)
    with pytest.raises(ModelLoadError, match="needs the quantized matmul"):
        int8_activations_wanted("int8", quantized=False)


@needs_native
def test_bf16_prefill_serves_long_products_as_tiles(quantized_gguf: Any) -> None:
    """`bf16_prefill="on"`: every int8-served matrix (the head too) takes products of
    `MIN_ROWS` rows or more as bf16 tiles and long-context chunks attend in bf16; a step that
    many rows long (five prompts) gives logits close to the int8 kernel's alone. `off` leaves
    both untouched."""
    from deepinfer.kernels.linear.bf16_tiles import MIN_ROWS
    from deepinfer.model.attention import BF16_ATTENTION_FROM

    path, _ = quantized_gguf
    on = load_model(path, torch.float32, "cpu", matmul_activations="int8", bf16_prefill="on")
    off = load_model(path, torch.float32, "cpu", matmul_activations="int8", bf16_prefill="off")
    assert on.bf16_prefill and not off.bf16_prefill
    for loaded, rows in ((on, MIN_ROWS), (off, 0)):
        model: Any = loaded.model
        weights = [m.quantized for m in model.modules() if getattr(m, "quantized", None)]
        weights.append(model.lm_head_quantized)
        assert weights and all(
            isinstance(w, Int8PackedWeight) and w.bf16_rows == rows for w in weights
        )
        op = model.attention_backend.paged_prefill_attention
        assert getattr(op, "keywords", {}).get("bf16_from", 0) == (
            BF16_ATTENTION_FROM if rows else 0
        )
    gen = torch.Generator().manual_seed(2)
    pieces = [(r, torch.randint(0, 67, (60,), generator=gen).tolist(), 0) for r in range(5)]
    logits = []
    for loaded in (on, off):
        bind_fresh_caches(loaded.model, num_blocks=96, block_size=4)
        logits.append(torch.cat(run_step(loaded.model, SequentialBlocks(4), pieces, True)))
    got, want = logits
    assert got.shape[0] == 300 >= MIN_ROWS and not torch.equal(got, want)
    torch.testing.assert_close(got, want, atol=5e-2 * want.abs().max().item(), rtol=0)


@needs_native
def test_tiles_serve_the_formats_the_probe_chose(quantized_gguf: Any) -> None:
    """`serve_long_rows_bf16` with the probe's formats: the Q4_1 matrices take tiles only where
    Q4_1 is chosen, a Q8_0 head only where Q8_0 is."""
    from deepinfer.kernels.linear.bf16_tiles import MIN_ROWS
    from deepinfer.model.loading.quantized import serve_long_rows_bf16

    path, _ = quantized_gguf
    for formats in (frozenset({"Q8_0"}), frozenset({"Q4_1"}), frozenset({"Q4_1", "Q8_0"})):
        loaded = load_model(path, torch.float32, "cpu", matmul_activations="int8")
        model: Any = loaded.model
        for m in model.modules():
            if isinstance(getattr(m, "quantized", None), Int8PackedWeight):
                m.quantized = replace(m.quantized, bf16_rows=0)  # whatever this machine chose
        head = replace(model.lm_head_quantized, bf16_rows=0)
        model.lm_head_quantized = head
        count = serve_long_rows_bf16(model, formats)
        weights = [m.quantized for m in model.modules() if getattr(m, "quantized", None)]
        weights.append(model.lm_head_quantized)
        tiled = [w for w in weights if w.bf16_rows == MIN_ROWS]
        assert count == len(tiled) and (count > 0 or "Q4_1" not in formats)
        assert all(w.fmt.name in formats for w in tiled)
        assert all(w.bf16_rows == 0 for w in weights if w.fmt.name not in formats)
