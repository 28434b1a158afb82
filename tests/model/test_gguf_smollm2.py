"""The real SmolLM2 GGUF in float32 against Hugging Face transformers loading the same file.

Token ids come from transformers' own tokenizer for the GGUF, so these tests do not depend on
ours. Positions span many 16-token blocks; prefill, chunked prefill over a paged prefix, and
batched paged decode must all give transformers' logits, and greedy decoding its tokens.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from deepinfer.environment import default_model_path
from deepinfer.kernels.native.cpu_native import native_available
from deepinfer.model import LoadedModel, load_model
from tests.model.model_test_utils import (
    SequentialBlocks,
    bind_fresh_caches,
    chunked_prefill_logits,
    greedy_decode,
    prefill_then_decode_logits,
    run_step,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

DEVICE = os.environ.get("DEEPINFER_TEST_DEVICE", "cpu")
"""Where our model runs (`cuda` on a GPU machine: tests/gpu/README.md); transformers stays on CPU."""
BLOCK_SIZE = 16
ATOL = 1e-3
TEXTS = [
    "The history of the Roman Empire spans more than a thousand years. "
    "It began when Augustus became the first emperor in 27 BC, after a long period of civil war. "
    "Over the following centuries the empire grew to cover the whole Mediterranean basin, "
    "from Hispania in the west to Syria in the east, and from Britannia to Egypt. "
    "Roads, aqueducts and cities spread Roman law, Latin and trade across these lands. " * 2,
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "for i in range(20):\n    print(i, fibonacci(i))\n" * 3,
    "<|im_start|>user\nExplain in simple words why the sky is blue, and why sunsets are red. "
    "My daughter asked me this morning while we were walking to school, and I realised that I "
    "did not really know the answer myself. I remember something about light being scattered "
    "by the air, and about different colours having different wavelengths, but not how it fits "
    "together. Please keep it short enough for a seven-year-old, but correct enough that her "
    "science teacher would agree with it. Give two examples from everyday life and one number: "
    "the speed of light, 299792458 metres per second.<|im_end|>\n"
    "<|im_start|>assistant\nThe sky looks blue because",
]


@pytest.fixture(scope="module")
def smollm2_reference() -> tuple[Any, list[list[int]]]:
    """(transformers model, token id lists); the slow part of these tests, loaded once per module
    (and freed after it: a worker runs other files after this one)."""
    path = default_model_path()
    kwargs = {"gguf_file": path.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, dtype=torch.float32, **kwargs
    )
    hf_model.eval()
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXTS]
    return hf_model, prompts


@pytest.fixture(scope="module")
def smollm2_ours() -> LoadedModel:
    """The default, exact arithmetic (float32 activations): within ATOL of transformers."""
    return load_model(default_model_path(), torch.float32, DEVICE)


@pytest.fixture(scope="module")
def hf_logits(smollm2_reference: Any) -> list[torch.Tensor]:
    hf_model, prompts = smollm2_reference
    with torch.no_grad():
        return [hf_model(torch.tensor([p])).logits[0].float() for p in prompts]


def _fresh(loaded: LoadedModel) -> tuple[Any, SequentialBlocks]:
    bind_fresh_caches(loaded.model, num_blocks=256, block_size=BLOCK_SIZE)
    return loaded.model, SequentialBlocks(BLOCK_SIZE)


def _check(ours: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for got, want in zip(ours, expected, strict=True):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < ATOL


def test_prompts_span_many_blocks(smollm2_reference: Any) -> None:
    _, prompts = smollm2_reference
    assert all(100 <= len(p) <= 300 for p in prompts), [len(p) for p in prompts]


def test_metadata(smollm2_ours: Any) -> None:
    arch = smollm2_ours.arch
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (30, 576, 9, 3)
    assert arch.tie_word_embeddings and arch.rope_theta == 100000.0
    assert smollm2_ours.gguf_reader is not None
    if DEVICE == "cpu" and native_available():  # the comparisons then cover the native kernels
        assert smollm2_ours.quantized_bytes > 90e6  # Q4_1 matrices and the Q8_0 head, as stored
        assert smollm2_ours.model.attention_backend.name == "cpu"


def test_prefill_matches_transformers(
    smollm2_ours: Any, smollm2_reference: Any, hf_logits: Any
) -> None:
    model, blocks = _fresh(smollm2_ours)
    prompts = smollm2_reference[1]
    ours = run_step(model, blocks, [(i, p, 0) for i, p in enumerate(prompts)], all_rows=True)
    _check(ours, hf_logits)


def test_chunked_prefill_matches_transformers(
    smollm2_ours: Any, smollm2_reference: Any, hf_logits: Any
) -> None:
    model, blocks = _fresh(smollm2_ours)
    _check(chunked_prefill_logits(model, blocks, smollm2_reference[1], chunk=37), hf_logits)


def test_batched_decode_matches_transformers(
    smollm2_ours: Any, smollm2_reference: Any, hf_logits: Any
) -> None:
    model, blocks = _fresh(smollm2_ours)
    prompts = smollm2_reference[1]
    prefill_lens = [len(p) - n for p, n in zip(prompts, (24, 17, 9), strict=True)]
    ours = prefill_then_decode_logits(model, blocks, prompts, prefill_lens)
    _check(ours, [lg[n - 1 :] for lg, n in zip(hf_logits, prefill_lens, strict=True)])


def test_decodes_alongside_prefill_chunks_match_transformers(
    smollm2_ours: Any, smollm2_reference: Any, hf_logits: Any
) -> None:
    """Mixed steps: two requests decode one token each while the third prefills in chunks."""
    model, blocks = _fresh(smollm2_ours)
    prompts = smollm2_reference[1]
    starts = [len(prompts[0]) - 12, len(prompts[1]) - 12]
    decoded: list[list[torch.Tensor]] = [
        [lg] for lg in run_step(model, blocks, [(i, prompts[i][: starts[i]], 0) for i in (0, 1)])
    ]
    chunk, prefilled = 29, []
    for step in range(12):
        pieces = [(i, [prompts[i][starts[i] + step]], starts[i] + step) for i in (0, 1)]
        lo = step * chunk
        if lo < len(prompts[2]):
            pieces.append((2, prompts[2][lo : lo + chunk], lo))
        logits = run_step(model, blocks, pieces, all_rows=True)
        for i in (0, 1):
            decoded[i].append(logits[i][0])
        prefilled.extend(logits[2:])
    _check(
        [torch.stack(decoded[i][:-1]) for i in (0, 1)],
        [hf_logits[i][starts[i] - 1 : -1] for i in (0, 1)],
    )
    _check([torch.cat(prefilled)], [hf_logits[2][: 12 * chunk]])


def test_greedy_matches_transformers_generate(smollm2_ours: Any, smollm2_reference: Any) -> None:
    hf_model, prompts = smollm2_reference
    prompts = [prompts[0][:150], prompts[2]]
    model, blocks = _fresh(smollm2_ours)
    ours = greedy_decode(model, blocks, prompts, num_new=64)
    eos = hf_model.generation_config.eos_token_id
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)
        want = out[0, len(prompt) :].tolist()
        assert got[: len(want)] == want
        if len(want) < 64:  # transformers stopped at an end-of-sequence token
            assert want[-1] in (eos if isinstance(eos, list) else [eos])


@pytest.mark.skipif(DEVICE != "cpu" or not native_available(), reason="the native CPU kernels")
def test_int8_activations_stay_close_to_transformers(
    smollm2_reference: Any, hf_logits: Any
) -> None:
    """Activations rounded to int8 blocks (llama.cpp's arithmetic). Measured when written: mean
    |logit error| 0.16-0.18, max 1.4-1.8 (logits span +-40), the same top token at 98-99% of
    positions."""
    loaded = load_model(default_model_path(), torch.float32, "cpu", matmul_activations="int8")
    assert loaded.int8_activations
    model, blocks = _fresh(loaded)
    prompts = smollm2_reference[1]
    ours = run_step(model, blocks, [(i, p, 0) for i, p in enumerate(prompts)], all_rows=True)
    for got, want in zip(ours, hf_logits, strict=True):
        error = (got - want).abs()
        assert error.mean().item() < 0.3 and error.max().item() < 3.0
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.95


@pytest.mark.skipif(DEVICE != "cpu" or not native_available(), reason="native CPU kernels only")
def test_native_stack_is_bit_identical_on_the_real_model(
    smollm2_ours: Any, smollm2_reference: Any
) -> None:
    """Decode steps through the one-call decoder stack equal the layer-by-layer forward."""
    prompts = smollm2_reference[1]
    prefill_lens = [len(p) - n for p, n in zip(prompts, (6, 5, 4), strict=True)]
    outs = []
    for native in (False, True):
        model, blocks = _fresh(smollm2_ours)
        model.native_layers = native
        try:
            outs.append(prefill_then_decode_logits(model, blocks, prompts, prefill_lens))
        finally:
            model.native_layers = True
    assert smollm2_ours.model.native_stack() is not None
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
