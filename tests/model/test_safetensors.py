"""Tiny random Llama / Qwen2 / Qwen3 / Gemma 3 checkpoints: our loader and paged forward vs
transformers (Gemma 3's windows shorter than the prompts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer.model import BatchChunk, build_forward_batch, load_model, model_fingerprint
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.piecewise import PiecewiseForward
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
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


def _config(kind: str) -> Any:
    if kind == "llama":
        return transformers.LlamaConfig(**COMMON, rope_theta=10000.0, tie_word_embeddings=False)
    if kind == "qwen2":
        return transformers.Qwen2Config(**COMMON, rope_theta=1e6, tie_word_embeddings=True)
    if kind == "gemma3":  # windows of 8 keys, a full layer between two windowed ones
        return transformers.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 3}, head_dim=32, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
            query_pre_attn_scalar=24, tie_word_embeddings=True,
        )  # fmt: skip
    # head_dim differs from hidden_size / num_heads, as in real Qwen3 checkpoints
    return transformers.Qwen3Config(
        **COMMON, head_dim=32, rope_theta=1e6, tie_word_embeddings=False
    )


ARCHITECTURES = {"gemma3_text": "gemma3"}
"""Hugging Face model types we serve under another name."""


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any]:
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(_config(request.param))
    with torch.no_grad():  # random norms and biases, so that a missed one shows
        for name, param in hf_model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.copy_(
                    1.0 + 0.5 * torch.randn_like(param)
                    if "norm" in name
                    else torch.randn_like(param)
                )
    hf_model.eval()
    directory = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(directory, safe_serialization=True)
    return directory, hf_model


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in (23, 9, 41)]


def _hf_logits(hf_model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float()  # [T, V]


@pytest.mark.slow
def test_arch_flags(tiny: Any) -> None:
    directory, hf_model = tiny
    loaded = load_model(directory, torch.float32, "cpu")
    kind = ARCHITECTURES.get(hf_model.config.model_type, hf_model.config.model_type)
    assert loaded.arch.architecture == kind
    assert loaded.arch.qkv_bias == (kind == "qwen2")
    assert loaded.arch.qk_norm == (kind in ("qwen3", "gemma3"))
    assert loaded.arch.layer_windows == ((8, 0, 8) if kind == "gemma3" else ())
    assert loaded.arch.tie_word_embeddings == hf_model.config.tie_word_embeddings
    assert loaded.gguf_reader is None
    again = load_model(directory, torch.float32, "cpu")
    assert model_fingerprint(loaded, torch.float32, 16) == model_fingerprint(
        again, torch.float32, 16
    )
    assert model_fingerprint(loaded, torch.float32, 16) != model_fingerprint(
        loaded, torch.float32, 32
    )


@pytest.mark.parametrize("mode", ["prefill", "chunked", "decode"])
def test_logits_match_transformers(tiny: Any, mode: str) -> None:
    directory, hf_model = tiny
    model = load_model(directory, torch.float32, "cpu").model
    bind_fresh_caches(model, num_blocks=64, block_size=BLOCK_SIZE)
    _check_logits(model, hf_model, mode)


class _Piecewise:
    """`model(batch)` made of the model's pieces (`PiecewiseForward`), each run where a prefill
    CUDA graph would replay it, at a bucket of the next multiple of 16 tokens (padding rows)."""

    def __init__(self, model: Any) -> None:
        self.model, self.arch, self.norm = model, model.arch, model.norm
        model.requires_grad_(True)  # as GGUF-loaded linears are: pieces must not build autograd
        self.pieces = PiecewiseForward(model, 80, torch.device("cpu"))
        self.padding_rows = 0

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        tokens = -(-batch.num_tokens // 16) * 16
        self.padding_rows += tokens - batch.num_tokens
        return self.pieces.forward(batch, tokens, lambda i: self.pieces.piece(i, tokens)())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["prefill", "chunked", "decode"])
def test_piecewise_forward_matches_transformers(tiny: Any, mode: str) -> None:
    """The forward cut at attention (padded pieces, attention eager between them) gives
    transformers' logits and writes the KV of the whole forward, nothing for padding rows (on
    the torch backend, whose RoPE rotates q and k in place, as CUDA's kernels do)."""
    directory, hf_model = tiny
    model = load_model(directory, torch.float32, "cpu", attention_backend="torch").model
    bind_fresh_caches(model, num_blocks=64, block_size=BLOCK_SIZE)
    piecewise = _Piecewise(model)
    _check_logits(piecewise, hf_model, mode)
    assert piecewise.padding_rows > 0
    pieced_caches = model.kv_caches
    bind_fresh_caches(model, num_blocks=64, block_size=BLOCK_SIZE)
    _check_logits(model, hf_model, mode)
    for (k, v), (k_eager, v_eager) in zip(pieced_caches, model.kv_caches, strict=True):
        torch.testing.assert_close(k, k_eager, atol=1e-4, rtol=0)
        torch.testing.assert_close(v, v_eager, atol=1e-4, rtol=0)
        assert k[0].eq(0).all() and v[0].eq(0).all()  # the null block: no padding row wrote it
    with pytest.raises(ValueError, match="do not fit"):
        batch = build_forward_batch([BatchChunk(list(range(20)), 0, [1, 2, 3, 4, 5])], BLOCK_SIZE)
        piecewise.pieces.forward(batch, 16, lambda i: None)


def _check_logits(model: Any, hf_model: Any, mode: str) -> None:
    blocks = SequentialBlocks(BLOCK_SIZE)
    prompts = _prompts()
    if mode == "prefill":  # all prompts in one batch
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


def test_bfloat16_close(tiny: Any) -> None:
    directory, hf_model = tiny
    model: Any = load_model(directory, torch.bfloat16, "cpu").model
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    bind_fresh_caches(model, num_blocks=64, block_size=BLOCK_SIZE)
    prompt = _prompts()[0]
    (got,) = run_step(model, SequentialBlocks(BLOCK_SIZE), [(0, prompt, 0)], all_rows=True)
    assert got.dtype == torch.float32
    want = _hf_logits(hf_model, prompt)
    assert (got - want).abs().max() < 0.1 * want.abs().max()


def test_no_sampled_rows_gives_empty_logits(tiny: Any) -> None:
    directory, hf_model = tiny
    loaded = load_model(directory, torch.float32, "cpu")
    bind_fresh_caches(loaded.model, num_blocks=16, block_size=BLOCK_SIZE)
    prompt = _prompts()[0]
    batch = build_forward_batch([BatchChunk(prompt[:10], 0, [1, 2, 3], sample=False)], BLOCK_SIZE)
    assert loaded.model(batch).shape == (0, hf_model.config.vocab_size)
    rest = build_forward_batch([BatchChunk(prompt[10:], 10, [1, 2, 3, 4, 5, 6])], BLOCK_SIZE)
    torch.testing.assert_close(
        loaded.model(rest)[0], _hf_logits(hf_model, prompt)[-1], atol=1e-4, rtol=0
    )
