"""Shaping the distribution of sampled rows: temperature, then top-k, then top-p, then min-p.

Each step sees the previous one's result (HF `generate` order): top-p's nucleus is taken from
the distribution already cut to the top k, and min-p compares against the largest probability.
A filtered-out token gets logit -inf. Every step keeps at least the most likely token. All
functions take logits `[S, V]` and one parameter per row, and return new logits `[S, V]`;
rows whose parameter disables a step pass through untouched.

- top-k: keep the tokens whose logit is at least the k-th largest (ties with it are kept);
  0 or >= V disables it.
- top-p: sort by probability; keep a token if the probability mass strictly before it is below
  p, so the nucleus includes the token whose probability crosses p; 1.0 disables it.
- min-p: keep tokens with probability >= min_p * (largest probability); 0.0 disables it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.request import SamplingParams


def warp(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p: the logits actually sampled from (softmax them)."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature.unsqueeze(1)  # [S, V]
    logits = apply_top_k(logits, [p.top_k for p in params])
    logits = apply_top_p(logits, [p.top_p for p in params])
    return apply_min_p(logits, [p.min_p for p in params])


def apply_top_k(logits: torch.Tensor, top_k: Sequence[int]) -> torch.Tensor:
    vocab_size = logits.shape[1]
    picked = [i for i, k in enumerate(top_k) if 0 < k < vocab_size]
    if not picked:
        return logits
    index = torch.tensor(picked, device=logits.device)
    ks = torch.tensor([top_k[i] for i in picked], device=logits.device)
    sub = logits.index_select(0, index)  # [P, V]
    top_values = sub.topk(int(max(top_k[i] for i in picked)), dim=1).values  # [P, K]
    kth = top_values.gather(1, (ks - 1).unsqueeze(1))  # [P, 1]
    return logits.index_copy(0, index, sub.masked_fill(sub < kth, float("-inf")))


TOP_P_CANDIDATES = 1024
"""Top-p first looks for the nucleus among this many most likely tokens (a partial sort);
rows whose candidates hold less than p of the mass fall back to sorting the whole row."""


def apply_top_p(logits: torch.Tensor, top_p: Sequence[float]) -> torch.Tensor:
    picked = [i for i, p in enumerate(top_p) if p < 1.0]
    if not picked:
        return logits
    index = torch.tensor(picked, device=logits.device)
    ps = torch.tensor([top_p[i] for i in picked], device=logits.device).unsqueeze(1)  # [P, 1]
    sub = logits.index_select(0, index)  # [P, V]
    probs = sub.softmax(dim=1)
    if sub.shape[1] > TOP_P_CANDIDATES:
        values, order = probs.topk(TOP_P_CANDIDATES, dim=1)  # [P, C], most likely first
        drop = _nucleus_drop(values, order, ps, sub.shape[1], outside=True)
        if bool((values.sum(dim=1, keepdim=True) >= ps).all()):  # every nucleus is inside
            return logits.index_copy(0, index, sub.masked_fill(drop, float("-inf")))
    values, order = probs.sort(dim=1, descending=True)
    drop = _nucleus_drop(values, order, ps, sub.shape[1], outside=False)
    return logits.index_copy(0, index, sub.masked_fill(drop, float("-inf")))


def _nucleus_drop(
    values: torch.Tensor,  # [P, C] probabilities, descending
    order: torch.Tensor,  # [P, C] their token ids
    ps: torch.Tensor,  # [P, 1]
    vocab_size: int,
    outside: bool,
) -> torch.Tensor:  # [P, V] bool: tokens outside the nucleus (those not in `order`: `outside`)
    mass_before = values.cumsum(dim=1) - values
    keep = mass_before < ps
    keep[:, 0] = True
    drop = torch.full((values.shape[0], vocab_size), outside, device=values.device)
    return drop.scatter_(1, order, ~keep)


def apply_min_p(logits: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    picked = [i for i, p in enumerate(min_p) if p > 0.0]
    if not picked:
        return logits
    index = torch.tensor(picked, device=logits.device)
    ms = torch.tensor([min_p[i] for i in picked], device=logits.device).unsqueeze(1)  # [P, 1]
    sub = logits.index_select(0, index)  # [P, V]
    probs = sub.softmax(dim=1)
    drop = probs < ms * probs.amax(dim=1, keepdim=True)
    return logits.index_copy(0, index, sub.masked_fill(drop, float("-inf")))
