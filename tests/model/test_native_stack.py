"""The decoder stack as one native call (`kernels/cpu/llama_layers.c`): bit-identical logits and
KV to the layer-by-layer forward on the same kernels, for prefill chunks, decode batches and
mixed steps, float32 and int8 activations, Llama layers and Gemma 3's (sliding windows shorter
than the contexts, q/k norms, sandwich norms, gelu_tanh) and Qwen3's (q/k norms); used only
where it applies, refused with a reason elsewhere. (The real models' comparisons against
transformers run through it too.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

import deepinfer.kernels.layers.llama_layers_cpu as stack_module
from deepinfer.kernels.attention.paged_attention_cpu import NATIVE_ALWAYS_ROWS
from deepinfer.model import load_model
from deepinfer.model.attention import torch_backend
from tests.model.model_test_utils import SequentialBlocks, bind_fresh_caches, run_step
from tests.model.test_gguf_loader import write_gemma3_gguf, write_gguf
from tests.model.test_quantized import needs_native, quantized_gguf  # noqa: F401 (a fixture)

transformers = pytest.importorskip("transformers")
Q8_0, Q4_1 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1
WINDOW = 8


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    run = stack_module.NativeLayerStack.run

    def counted(self: Any, *args: Any) -> Any:
        calls[0] += 1
        return run(self, *args)

    monkeypatch.setattr(stack_module.NativeLayerStack, "run", counted)
    return calls


def _steps(model: Any, native: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefill three prompts in chunks, then decode them together with a fourth prompt's chunk:
    (every step's logits, the final KV caches)."""
    model.native_layers = native
    bind_fresh_caches(model, num_blocks=64, block_size=4)
    blocks = SequentialBlocks(4)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 67, (n,), generator=gen).tolist() for n in (9, 14, 5, 11)]
    logits = run_step(model, blocks, [(i, p[:6], 0) for i, p in enumerate(prompts[:3])], True)
    logits += run_step(model, blocks, [(0, prompts[0][6:], 6), (1, prompts[1][6:], 6)], True)
    lens = [9, 14, 6]
    for step in range(4):
        pieces = [(i, [(step * 7 + i) % 67], lens[i]) for i in range(3)]
        if step == 1:
            pieces.append((3, prompts[3], 0))  # a short chunk among decodes
        logits += run_step(model, blocks, pieces, True)
        lens = [n + 1 for n in lens]
    caches = [c.clone() for pair in model.kv_caches for c in pair]
    return logits, caches


def _assert_stack_is_the_layers(
    model: Any, steps: Any, native_steps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`steps` run layer by layer, then through the stack: every logit and KV bit the same, and
    every one of the `native_steps` steps through the stack."""
    layered, layered_kv = steps(model, native=False)
    calls = _counting(monkeypatch)
    stacked, stacked_kv = steps(model, native=True)
    assert calls[0] == native_steps, "every step of this test is all native rows"
    for a, b in zip(layered + layered_kv, stacked + stacked_kv, strict=True):
        assert torch.equal(a, b)


@needs_native
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_stack_is_bit_identical_to_the_layers(
    quantized_gguf: Any,  # noqa: F811
    activations: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, _ = quantized_gguf
    model = load_model(path, torch.float32, "cpu", matmul_activations=activations).model
    _assert_stack_is_the_layers(model, _steps, 6, monkeypatch)


@needs_native
def test_long_chunks_keep_the_layers(
    quantized_gguf: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chunk too long for the decode kernel (torch's fused attention) goes layer by layer:
    more queries than the kernel always takes, and more query-key pairs than it takes."""
    path, _ = quantized_gguf
    model = load_model(path, torch.float32, "cpu").model
    monkeypatch.setattr(
        "deepinfer.kernels.attention.paged_attention_cpu.NATIVE_MAX_CHUNK_PAIRS", 100
    )
    bind_fresh_caches(model, num_blocks=64, block_size=4)
    calls = _counting(monkeypatch)
    prompt = list(range(1, NATIVE_ALWAYS_ROWS + 10))
    (got,) = run_step(model, SequentialBlocks(4), [(0, prompt, 0)], True)
    assert calls[0] == 0 and model.native_stack() is not None
    model.native_layers = False
    bind_fresh_caches(model, num_blocks=64, block_size=4)
    (want,) = run_step(model, SequentialBlocks(4), [(0, prompt, 0)], True)
    assert torch.equal(got, want)


@needs_native
def test_stack_is_refused_where_it_does_not_apply(quantized_gguf: Any) -> None:  # noqa: F811
    path, _ = quantized_gguf
    plain = load_model(path, torch.float32, "cpu", quantized_matmul="off").model
    bind_fresh_caches(plain, num_blocks=8, block_size=4)
    assert plain.native_stack() is None and "quantized" in plain._stack
    model = load_model(path, torch.float32, "cpu").model
    assert model.native_stack() is None and "bound caches" in model._stack  # none bound yet
    bind_fresh_caches(model, num_blocks=8, block_size=4)
    assert model.native_stack() is not None
    model.set_attention_backend(torch_backend())
    assert model.native_stack() is None and "cpu attention backend" in model._stack


def _tiny_config(kind: str) -> Any:
    """Widths of whole 32-weight blocks; Gemma 3's windows of 8 keys around a full layer."""
    common = dict(
        vocab_size=67, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )  # fmt: skip
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, num_hidden_layers=2, rope_theta=5000.0)
    windowed = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    return transformers.Gemma3TextConfig(
        **common, num_hidden_layers=4, sliding_window=WINDOW, layer_types=windowed
    )


@pytest.fixture(
    scope="module",
    params=[("gemma3", Q8_0), ("gemma3", Q4_1), ("qwen3", Q8_0)],
    ids=["gemma3-q8_0", "gemma3-q4_1", "qwen3-q8_0"],
)
def qk_norm_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model with q/k norms, every layer matrix in Q8_0 or Q4_1 blocks."""
    kind, matrices = request.param
    torch.manual_seed(11)
    hf_model = transformers.AutoModelForCausalLM.from_config(_tiny_config(kind)).eval()
    with torch.no_grad():  # random norms, so that a norm applied twice or missed shows
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.copy_(0.5 + torch.rand_like(param))
    path = tmp_path_factory.mktemp("qk-norm") / f"tiny-{kind}.gguf"
    if kind == "gemma3":
        windowed = [t == "sliding_attention" for t in hf_model.config.layer_types]
        write_gemma3_gguf(path, hf_model, windowed, matrices)
    else:
        write_gguf(path, kind, hf_model, tie=True, matrices=matrices)
    return path


def _window_steps(model: Any, native: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three prompts (31, 6 and 19 tokens) prefilled in one step, then decoded together for ten
    steps, a fourth prompt's 12-token chunk joining the third step: contexts from 6 to 41 keys,
    windows of 8 (the short request crosses its first window while decoding)."""
    model.native_layers = native
    bind_fresh_caches(model, num_blocks=64, block_size=4)
    blocks = SequentialBlocks(4)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 67, (n,), generator=gen).tolist() for n in (31, 6, 19, 12)]
    logits = run_step(model, blocks, [(i, p, 0) for i, p in enumerate(prompts[:3])], True)
    lens = [31, 6, 19]
    for step in range(10):
        pieces = [(i, [(step * 5 + i) % 67], lens[i]) for i in range(3)]
        if step == 2:
            pieces.append((3, prompts[3], 0))
        logits += run_step(model, blocks, pieces, True)
        lens = [n + 1 for n in lens]
    return logits, [c.clone() for pair in model.kv_caches for c in pair]


@needs_native
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_windows_and_qk_norms_are_bit_identical_to_the_layers(
    qk_norm_gguf: Path, activations: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(qk_norm_gguf, torch.float32, "cpu", matmul_activations=activations).model
    if model.arch.architecture == "gemma3":
        assert model.arch.layer_windows == (WINDOW, WINDOW, 0, WINDOW)
        assert not torch.equal(model.cos_sin, model.cos_sin_local)
    _assert_stack_is_the_layers(model, _window_steps, 11, monkeypatch)


@pytest.fixture(scope="module")
def mixed_qkv_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 model (q/k/v biases, random) stored as llama.cpp's Q4_K_M stores
    some layers: q and k in one format, v in another (here Q4_1 and Q8_0, whose widths fit)."""
    torch.manual_seed(13)
    config = transformers.Qwen2Config(
        vocab_size=67, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
        num_hidden_layers=2, rope_theta=5000.0, tie_word_embeddings=True,
    )  # fmt: skip
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("proj.bias"):
                param.copy_(torch.randn_like(param))
    path = tmp_path_factory.mktemp("mixed-qkv") / "tiny-qwen2.gguf"
    write_gguf(path, "qwen2", hf_model, tie=True, matrices=Q4_1, formats={"attn_v.weight": Q8_0})
    return path


@needs_native
def test_biased_qkv_in_two_formats_is_bit_identical_to_the_layers(
    mixed_qkv_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen2's q/k/v bias and a q/k/v projection in two formats run in the stack (int8: one
    packed weight that switches format at v's rows), with the layers' bits."""
    model = load_model(mixed_qkv_gguf, torch.float32, "cpu", matmul_activations="int8").model
    qkv = model.layers[0].self_attn.qkv_proj.quantized
    assert qkv is not None and qkv.fmt2 is not None and qkv.rows2 == 32
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    _assert_stack_is_the_layers(model, _window_steps, 11, monkeypatch)


@needs_native
def test_the_stack_scales_queries_as_the_layers(qk_norm_gguf: Path) -> None:
    """A query scale other than 1 / sqrt(head_dim) (Gemma 3 27B's kind) reaches the stack."""
    model = load_model(qk_norm_gguf, torch.float32, "cpu").model
    model.arch = dataclasses.replace(model.arch, query_scale=0.3)
    for layer in model.layers:
        layer.self_attn.scale = 0.3
    layered, _ = _window_steps(model, native=False)
    stacked, _ = _window_steps(model, native=True)
    assert model.native_stack() is not None and model.native_stack().shape.scale == 0.3
    for a, b in zip(layered, stacked, strict=True):
        assert torch.equal(a, b)


def test_stack_checks_its_inputs(tmp_path: Path) -> None:
    shape = stack_module.StackShape(64, 4, 2, 24, 96, 1e-5, 0.2)
    with pytest.raises(ValueError, match="head size 24"):
        stack_module.NativeLayerStack([], shape)
    shape = stack_module.StackShape(64, 6, 4, 16, 96, 1e-5, 0.25)
    with pytest.raises(ValueError, match="6 query heads over 4"):
        stack_module.NativeLayerStack([], shape)
    shape = stack_module.StackShape(64, 4, 2, 16, 96, 1e-5, 0.25)
    with pytest.raises(ValueError, match="no layers"):
        stack_module.NativeLayerStack([], shape)


@needs_native
def test_stack_checks_each_layers_extras(qk_norm_gguf: Path) -> None:
    model = load_model(qk_norm_gguf, torch.float32, "cpu").model
    bind_fresh_caches(model, num_blocks=8, block_size=4)
    stack = model.native_stack()
    assert stack is not None
    layers = list(stack._layers_kept)
    bad = {
        "q_norm": torch.ones(8),
        "mlp_out_norm": torch.ones(64, dtype=torch.float64),
        "cos_sin": model.cos_sin[:, :8].contiguous(),
        "window": -1,
    }
    for field, value in bad.items():
        broken = [dataclasses.replace(layers[0], **{field: value}), *layers[1:]]
        with pytest.raises(ValueError):
            stack_module.NativeLayerStack(broken, stack.shape)
    shorter = dataclasses.replace(layers[0], cos_sin=model.cos_sin[:64].contiguous())
    with pytest.raises(ValueError, match="same positions"):
        stack_module.NativeLayerStack([shorter, *layers[1:]], stack.shape)
