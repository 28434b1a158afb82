"""Logit adjustments that depend on a request's tokens, applied in place in this order:

1. suppression: the row's `suppress_token_ids` get -inf;
2. repetition penalty (HF / CTRL): for every token seen in prompt + output, a positive logit is
   divided by the penalty and a non-positive one multiplied by it;
3. presence and frequency penalties (OpenAI): on output tokens only,
   `logit -= presence * (count > 0) + frequency * count`.

-inf stays -inf through 2 and 3, so a suppressed token stays suppressed. Every function works on
the whole batch at once: per-row parameters become `[P, 1]` columns and token counts a `[P, V]`
tensor built with one scatter, so the cost does not grow with Python loops over the vocabulary.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from deepinfer.sampling.row import SamplingRow


def apply_suppression(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Set `logits[i, t] = -inf` for every t in `rows[i].suppress_token_ids` (in place)."""
    vocab_size = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        if not row.suppress_token_ids:
            continue
        ids = [t for t in row.suppress_token_ids if 0 <= t < vocab_size]
        row_index.extend([i] * len(ids))
        token_index.extend(ids)
    if token_index:
        rows_t = torch.tensor(row_index, device=logits.device)
        tokens_t = torch.tensor(token_index, device=logits.device)
        logits[rows_t, tokens_t] = float("-inf")


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Apply repetition, presence and frequency penalties to the rows that ask (in place)."""
    picked = [i for i, row in enumerate(rows) if row.params.needs_penalties]
    if not picked:
        return
    device = logits.device
    vocab_size = logits.shape[1]
    params = [rows[i].params for i in picked]
    index = torch.tensor(picked, device=device)
    sub = logits.index_select(0, index)  # [P, V]
    counts = token_counts([rows[i].output_token_ids for i in picked], vocab_size, device)
    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = [
            rows[i].prompt_token_ids if p.repetition_penalty != 1.0 else ()
            for i, p in zip(picked, params, strict=True)
        ]
        seen = (counts > 0) | (token_counts(prompts, vocab_size, device) > 0)
        penalty = _column([p.repetition_penalty for p in params], device)
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        presence = _column([p.presence_penalty for p in params], device)
        frequency = _column([p.frequency_penalty for p in params], device)
        sub = sub - presence * (counts > 0) - frequency * counts
    logits.index_copy_(0, index, sub)


def token_counts(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """`[len(token_lists), V]` float32: how many times each token occurs in each list."""
    counts = torch.zeros(len(token_lists), vocab_size, device=device)
    lengths = [len(tokens) for tokens in token_lists]
    total = sum(lengths)
    if total == 0:
        return counts
    flat = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    row_of = torch.repeat_interleave(torch.arange(len(token_lists)), torch.tensor(lengths))
    ones = torch.ones(total, device=device)
    counts.index_put_((row_of.to(device), flat.to(device)), ones, accumulate=True)
    return counts


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)  # [P, 1]
