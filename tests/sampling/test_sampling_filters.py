"""Temperature, top-k, top-p and min-p: exact distributions vs the reference, then real draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deepinfer.request import SamplingParams
from deepinfer.sampling import Sampler, SamplingRow
from deepinfer.sampling.filters import warp
from tests.sampling.sampling_reference import assert_matches, final_probs

NUM_SAMPLES = 20_000

PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.5),
    SamplingParams(top_k=3),
    SamplingParams(top_k=1),
    SamplingParams(top_p=0.6),
    SamplingParams(top_p=0.05),
    SamplingParams(min_p=0.1),
    SamplingParams(min_p=1.0),
    SamplingParams(temperature=0.7, top_k=6, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.3, top_k=200, top_p=0.95),
]


def _logits(vocab_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab_size, generator=g) * 2.0


def _draw(logits: torch.Tensor, params: SamplingParams, seeded: bool) -> np.ndarray:
    """Histogram of NUM_SAMPLES draws: one batched call of identical rows."""
    generators = [
        torch.Generator().manual_seed(1000 + i) if seeded else None for i in range(NUM_SAMPLES)
    ]
    rows = [SamplingRow(params, generator=g) for g in generators]
    batch = logits.unsqueeze(0).expand(NUM_SAMPLES, -1)
    tokens = [t.token_id for t in Sampler(seed=11).sample(batch, rows)]
    return np.bincount(tokens, minlength=logits.shape[0]).astype(np.float64)


def test_warp_matches_reference_distribution() -> None:
    logits = torch.stack([_logits(40, seed=i) for i in range(len(PARAMS))])
    probs = warp(logits, PARAMS).softmax(dim=1)
    for i, params in enumerate(PARAMS):
        expected = final_probs(logits[i].numpy().astype(np.float64), params)
        np.testing.assert_allclose(probs[i].numpy(), expected, atol=1e-6)
        assert (probs[i].numpy() > 0).sum() == (expected > 0).sum()


@pytest.mark.parametrize(
    ("temperature", "seeded"), [(0.6, False), (1.0, False), (1.0, True), (1.7, False)]
)
def test_temperature_histogram(temperature: float, seeded: bool) -> None:
    """seeded: every row draws from its own generator; otherwise all share the sampler's."""
    logits = _logits(12, seed=7)
    counts = _draw(logits, SamplingParams(temperature=temperature), seeded)
    expected = torch.softmax(logits.double() / temperature, dim=0).numpy()
    assert_matches(counts, expected)


def test_top_k_never_leaves_the_top_k() -> None:
    logits = _logits(30, seed=8)
    counts = _draw(logits, SamplingParams(top_k=4, temperature=1.5), seeded=False)
    top4 = set(torch.topk(logits, 4).indices.tolist())
    assert set(np.nonzero(counts)[0].tolist()) == top4
    assert_matches(
        counts,
        final_probs(logits.numpy().astype(np.float64), SamplingParams(top_k=4, temperature=1.5)),
    )


@pytest.mark.parametrize(("top_p", "nucleus"), [(0.45, {0}), (0.55, {0, 1}), (0.81, {0, 1, 2})])
def test_top_p_nucleus_includes_the_crossing_token(top_p: float, nucleus: set[int]) -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    params = SamplingParams(top_p=top_p)
    counts = _draw(logits, params, seeded=False)
    assert set(np.nonzero(counts)[0].tolist()) == nucleus
    assert_matches(counts, final_probs(logits.numpy().astype(np.float64), params))


def test_min_p_drops_tokens_below_the_threshold() -> None:
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.03, 0.02])
    params = SamplingParams(min_p=0.2)  # threshold 0.08: keeps the first four
    counts = _draw(probs.log(), params, seeded=True)
    assert set(np.nonzero(counts)[0].tolist()) == {0, 1, 2, 3}
    expected = probs.double().numpy()[:4] / probs[:4].sum().item()
    assert_matches(counts, np.concatenate([expected, [0.0, 0.0]]))


def test_combined_filters_histogram() -> None:
    logits = _logits(25, seed=9)
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.02)
    counts = _draw(logits, params, seeded=False)
    assert_matches(counts, final_probs(logits.numpy().astype(np.float64), params))


def test_filters_with_ties_keep_all_tied_tokens() -> None:
    logits = torch.tensor([[2.0, 2.0, 2.0, 1.0, 0.0]])
    out = warp(logits, [SamplingParams(top_k=2)])
    assert torch.isfinite(out[0, :3]).all() and math.isinf(out[0, 4].item())


@pytest.mark.parametrize(("scale", "top_p"), [(6.0, 0.9), (6.0, 0.999), (0.5, 0.5), (0.5, 0.95)])
def test_top_p_on_a_large_vocabulary_matches_the_reference(scale: float, top_p: float) -> None:
    """Past `TOP_P_CANDIDATES` tokens the nucleus is first sought among the most likely ones
    (peaked rows), else in a full sort (flat rows): both give the reference's support."""
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(3, 5000, generator=g) * scale
    params = SamplingParams(top_p=top_p)
    out = warp(logits, [params] * 3)
    for row, warped in zip(logits.numpy().astype(np.float64), out, strict=True):
        expected = final_probs(row, params) > 0
        assert np.array_equal(torch.isfinite(warped).numpy(), expected)
