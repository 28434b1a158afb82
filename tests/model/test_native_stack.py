"""The decoder stack as one native call (`kernels/cpu/llama_layers.c`): bit-identical logits and
KV to the layer-by-layer forward on the same kernels, for prefill chunks, decode batches and
mixed steps, float32 and int8 activations; used only where it applies, refused with a reason
elsewhere. (The real model's comparisons against transformers run through it too.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from model_test_utils import SequentialBlocks, bind_fresh_caches, run_step
from test_model_quantized import needs_native, quantized_gguf  # noqa: F401 (a fixture)

import deepinfer.kernels.llama_layers_cpu as stack_module
from deepinfer.kernels.paged_attention_cpu import NATIVE_ALWAYS_ROWS
from deepinfer.model import load_model
from deepinfer.model.attention import torch_backend


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


@needs_native
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_stack_is_bit_identical_to_the_layers(
    quantized_gguf: Any,  # noqa: F811
    activations: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, _ = quantized_gguf
    model = load_model(path, torch.float32, "cpu", matmul_activations=activations).model
    layered, layered_kv = _steps(model, native=False)
    calls = _counting(monkeypatch)
    stacked, stacked_kv = _steps(model, native=True)
    assert calls[0] == 6, "every step of this test is all native rows"
    for a, b in zip(layered + layered_kv, stacked + stacked_kv, strict=True):
        assert torch.equal(a, b)


@needs_native
def test_long_chunks_keep_the_layers(
    quantized_gguf: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chunk too long for the decode kernel (torch's fused attention) goes layer by layer:
    more queries than the kernel always takes, and more query-key pairs than it takes."""
    path, _ = quantized_gguf
    model = load_model(path, torch.float32, "cpu").model
    monkeypatch.setattr("deepinfer.kernels.paged_attention_cpu.NATIVE_MAX_CHUNK_PAIRS", 100)
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


def test_stack_checks_its_inputs(tmp_path: Path) -> None:
    shape = stack_module.StackShape(64, 4, 2, 24, 96, 1e-5, 0.2)
    with pytest.raises(ValueError, match="head size 24"):
        stack_module.NativeLayerStack([], shape, torch.zeros(8, 24))
    shape = stack_module.StackShape(64, 6, 4, 16, 96, 1e-5, 0.25)
    with pytest.raises(ValueError, match="6 query heads over 4"):
        stack_module.NativeLayerStack([], shape, torch.zeros(8, 16))
