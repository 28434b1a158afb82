"""An independent, per-row reference of the sampling spec (numpy float64, plain loops).

Written from the spec, not from deepinfer/sampling: suppression, repetition penalty (HF),
presence/frequency penalties (OpenAI), then temperature, top-k, top-p, min-p.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from deepinfer.request import SamplingParams
from deepinfer.sampling import SamplingRow


def processed_logits(logits: np.ndarray, row: SamplingRow) -> np.ndarray:
    """Logits after suppression and penalties, for one row."""
    x = logits.astype(np.float64).copy()
    vocab_size = len(x)
    for t in row.suppress_token_ids:
        if 0 <= t < vocab_size:
            x[t] = -np.inf
    p = row.params
    if p.repetition_penalty != 1.0:
        for t in set(row.prompt_token_ids) | set(row.output_token_ids):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, count in Counter(row.output_token_ids).items():
        x[t] -= p.presence_penalty + p.frequency_penalty * count
    return x


def softmax(x: np.ndarray) -> np.ndarray:
    finite = np.isfinite(x)
    out = np.zeros_like(x)
    e = np.exp(x[finite] - x[finite].max())
    out[finite] = e / e.sum()
    return out


def final_probs(processed: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a sampled (non-greedy) row draws from."""
    x = processed / params.temperature
    vocab_size = len(x)
    if 0 < params.top_k < vocab_size:
        kth = sorted(x.tolist(), reverse=True)[params.top_k - 1]
        x = np.where(x < kth, -np.inf, x)
    if params.top_p < 1.0:
        probs = softmax(x)
        keep = np.zeros(vocab_size, dtype=bool)
        mass = 0.0
        for t in sorted(range(vocab_size), key=lambda t: -probs[t]):
            if mass >= params.top_p:
                break
            keep[t] = True
            mass += probs[t]
        x = np.where(keep, x, -np.inf)
    if params.min_p > 0.0:
        probs = softmax(x)
        x = np.where(probs < params.min_p * probs.max(), -np.inf, x)
    return softmax(x)


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the cells with positive probability, and its degrees of freedom."""
    n = counts.sum()
    cells = probs > 0
    expected = probs[cells] * n
    stat = float((((counts[cells] - expected) ** 2) / expected).sum())
    return stat, int(cells.sum()) - 1


def assert_matches(counts: np.ndarray, probs: np.ndarray) -> None:
    """Samples fall only where probs > 0, and their histogram passes a ~6-sigma chi-square bound."""
    assert counts[probs == 0].sum() == 0, "sampled a token with probability 0"
    stat, dof = chi_square(counts, probs)
    bound = dof + 6.0 * (2.0 * dof) ** 0.5 + 10.0
    assert stat < bound, f"chi-square {stat:.1f} over {dof} dof exceeds {bound:.1f}"
