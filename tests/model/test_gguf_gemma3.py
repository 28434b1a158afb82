"""The real Gemma 3 270M GGUF in float32 against Hugging Face transformers loading the same file.

Fifteen of its eighteen layers attend a 512-token window: the prompts run past two windows, so
prefill, chunked prefill over a paged prefix and batched paged decode all cross window edges.
Token ids come from transformers' own tokenizer (BOS first).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from deepinfer.environment import default_model_dir
from deepinfer.kernels.native.cpu_native import native_available
from deepinfer.model import LoadedModel, load_model
from deepinfer.model.loading.quantized import float_matrices
from tests.model.model_test_utils import (
    SequentialBlocks,
    bind_fresh_caches,
    chunked_prefill_logits,
    greedy_decode,
    prefill_then_decode_logits,
    run_step,
)
from tests.model.test_native_stack import _counting

transformers = pytest.importorskip("transformers")
GEMMA3 = default_model_dir() / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not GEMMA3.is_file(), reason="run `deepinfer pull gemma3-270m`"),
]

BLOCK_SIZE = 16
ATOL = 1e-3
WINDOW = 512
COLUMNS = 32768
"""Logits compared over the first 32k of the 262k-token vocabulary: every position's hidden
state shows in them, and a 1,400-token prompt's whole logits take 1.5 GB a copy."""


def _text(seed: int, sentences: int) -> str:
    """Plain prose of a fixed seed: long prompts without a file to keep."""
    rng = random.Random(seed)
    names = ["Ada", "the engineer", "a small robot", "the old captain", "Mira", "the committee"]
    verbs = ["measured", "repaired", "described", "carried", "questioned", "painted"]
    things = ["the bridge", "a lighthouse", "the river", "seven lanterns", "the map", "a garden"]
    tails = ["before dawn", "in the rain", "with great care", "for the third time", "at noon"]
    return " ".join(
        f"{rng.choice(names).capitalize()} {rng.choice(verbs)} {rng.choice(things)} "
        f"{rng.choice(tails)}."
        for _ in range(sentences)
    )


TEXTS = [_text(0, 120), _text(1, 140), "def area(r):\n    return 3.14159 * r * r\n" * 20]


@pytest.fixture(scope="module")
def gemma3_reference() -> tuple[Any, list[list[int]]]:
    """(transformers model, token id lists); the slow part of these tests, loaded once per module
    (and freed after it: a worker runs other files after this one)."""
    kwargs = {"gguf_file": GEMMA3.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(GEMMA3.parent, **kwargs)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        GEMMA3.parent, dtype=torch.float32, **kwargs
    )
    hf_model.eval()
    return hf_model, [tokenizer(text)["input_ids"] for text in TEXTS]


@pytest.fixture(scope="module")
def gemma3_ours() -> LoadedModel:
    return load_model(GEMMA3, torch.float32, "cpu")


@pytest.fixture(scope="module")
def gemma3_logits(gemma3_reference: Any) -> list[torch.Tensor]:
    hf_model, prompts = gemma3_reference
    with torch.no_grad():
        return [hf_model(torch.tensor([p])).logits[0, :, :COLUMNS].clone() for p in prompts]


def _fresh(loaded: LoadedModel) -> tuple[Any, SequentialBlocks]:
    bind_fresh_caches(loaded.model, num_blocks=320, block_size=BLOCK_SIZE)
    return loaded.model, SequentialBlocks(BLOCK_SIZE)


def _check(ours: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for got, want in zip(ours, expected, strict=True):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < ATOL


def test_prompts_cross_two_windows(gemma3_reference: Any) -> None:
    _, prompts = gemma3_reference
    assert all(p[0] == 2 for p in prompts)  # BOS
    assert len(prompts[0]) > 2 * WINDOW and len(prompts[1]) > 2 * WINDOW, [len(p) for p in prompts]
    assert len(prompts[2]) < WINDOW  # and one inside a window


def test_metadata(gemma3_ours: LoadedModel) -> None:
    a = gemma3_ours.arch
    assert (a.architecture, a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads) == (
        "gemma3", 18, 640, 4, 1,
    )  # fmt: skip
    assert a.head_dim == 256 and a.vocab_size == 262144 and a.tie_word_embeddings and a.qk_norm
    assert [i for i in range(18) if a.window(i) is None] == [5, 11, 17]
    assert {a.window(i) for i in range(18)} == {None, WINDOW}
    assert (a.rope_theta, a.rope_local_theta, a.attention_scale) == (1e6, 1e4, 1 / 16)
    if native_available():  # the comparisons then cover the native kernels, K-quants included
        assert gemma3_ours.model.attention_backend.name == "cpu"
        assert gemma3_ours.quantized_bytes > 250e6 and not float_matrices(gemma3_ours.model)


def test_prefill_matches_transformers(
    gemma3_ours: LoadedModel, gemma3_reference: Any, gemma3_logits: Any
) -> None:
    model, blocks = _fresh(gemma3_ours)
    prompts = gemma3_reference[1]
    pieces = [(i, p, 0) for i, p in enumerate(prompts)]
    _check(run_step(model, blocks, pieces, all_rows=True, columns=COLUMNS), gemma3_logits)


def test_chunked_prefill_matches_transformers(
    gemma3_ours: LoadedModel, gemma3_reference: Any, gemma3_logits: Any
) -> None:
    """Chunks of 200: a chunk's window reaches into the paged keys of the chunks before it."""
    model, blocks = _fresh(gemma3_ours)
    ours = chunked_prefill_logits(model, blocks, gemma3_reference[1], chunk=200, columns=COLUMNS)
    _check(ours, gemma3_logits)


def test_batched_decode_matches_transformers(
    gemma3_ours: LoadedModel, gemma3_reference: Any, gemma3_logits: Any
) -> None:
    model, blocks = _fresh(gemma3_ours)
    prompts = gemma3_reference[1]
    prefill_lens = [len(p) - n for p, n in zip(prompts, (20, 13, 7), strict=True)]
    ours = prefill_then_decode_logits(model, blocks, prompts, prefill_lens, columns=COLUMNS)
    _check(ours, [lg[n - 1 :] for lg, n in zip(gemma3_logits, prefill_lens, strict=True)])


def test_greedy_matches_transformers_generate(
    gemma3_ours: LoadedModel, gemma3_reference: Any
) -> None:
    hf_model, prompts = gemma3_reference
    prompts = [prompts[1], prompts[2]]
    model, blocks = _fresh(gemma3_ours)
    ours = greedy_decode(model, blocks, prompts, num_new=24)
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        want = out[0, len(prompt) :].tolist()
        assert len(want) == 24 and got == want


@pytest.mark.skipif(not native_available(), reason="the native CPU kernels")
def test_native_stack_is_bit_identical_on_the_real_model(
    gemma3_ours: LoadedModel, gemma3_reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps through the one-call decoder stack (windowed and full layers, q/k norms,
    the norms of the attention and FFN outputs, gelu_tanh) equal the layer-by-layer forward,
    contexts past two windows included."""
    prompts = gemma3_reference[1]
    prefill_lens = [len(p) - n for p, n in zip(prompts, (6, 5, 4), strict=True)]
    outs = []
    for native in (False, True):
        model, blocks = _fresh(gemma3_ours)
        model.native_layers = native
        calls = _counting(monkeypatch)
        try:
            outs.append(prefill_then_decode_logits(model, blocks, prompts, prefill_lens))
        finally:
            model.native_layers = True
            monkeypatch.undo()
        assert calls[0] == (6 if native else 0)  # every decode step, no long prompt
    assert gemma3_ours.model.native_stack() is not None
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not native_available(), reason="the native CPU kernels")
def test_int8_activations_stay_close_to_transformers(
    gemma3_reference: Any, gemma3_logits: Any
) -> None:
    """The serving default: activations rounded to int8 blocks against every matrix format of
    the file (Q4_K, Q6_K, Q5_0 as Q8_0, Q8_0). Measured when written on a 1,300-token prompt:
    mean |logit error| 0.12 (logits span -38..31), mean KL divergence 0.003 nats, the same top
    token at 97% of positions (the whole vocabulary); the largest single error (3-6) is larger
    than SmolLM2's."""
    loaded = load_model(GEMMA3, torch.float32, "cpu", matmul_activations="int8")
    assert loaded.int8_activations
    model, blocks = _fresh(loaded)
    prompts = gemma3_reference[1]
    pieces = [(i, p, 0) for i, p in enumerate(prompts)]
    ours = run_step(model, blocks, pieces, all_rows=True, columns=COLUMNS)
    for got, want in zip(ours, gemma3_logits, strict=True):  # over the compared columns
        log_p, log_q = want.log_softmax(-1), got.log_softmax(-1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [T]
        assert (got - want).abs().mean().item() < 0.3 and kl.mean().item() < 0.01, kl.mean()
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.95
