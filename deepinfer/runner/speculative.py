"""Verifying a step's draft tokens against the model's own picks (speculative decoding).

A chunk with drafts d_1..d_k computed the request's last token and the drafts; its k + 1 rows of
logits gave the model's picks t_1..t_{k+1} (greedy: `scheduler/speculative.py` drafts only where
that is how the request samples). Draft d_j is accepted while every d_i = t_i for i <= j; the
request's new tokens are t_1..t_{a+1} for `a` accepted drafts: exactly the tokens plain decoding
would pick one step at a time, since each t_i was computed after the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.outputs import SampledToken
from deepinfer.scheduler.output import ScheduledChunk


def verify_drafts(
    chunks: Sequence[ScheduledChunk], picks: Sequence[SampledToken]
) -> tuple[dict[str, SampledToken], dict[str, tuple[SampledToken, ...]]]:
    """(first token, the tokens after it) of every sampling chunk, from the picks of their
    logits rows in order (`ScheduledChunk.num_logits` rows each)."""
    sampled: dict[str, SampledToken] = {}
    accepted: dict[str, tuple[SampledToken, ...]] = {}
    row = 0
    for chunk in chunks:
        if not chunk.sample:
            continue
        rows = picks[row : row + chunk.num_logits]
        row += chunk.num_logits
        sampled[chunk.request_id] = rows[0]
        drafts = chunk.draft_token_ids
        if drafts:
            a = 0
            while a < len(drafts) and drafts[a] == rows[a].token_id:
                a += 1
            accepted[chunk.request_id] = tuple(rows[1 : a + 1])
    assert row == len(picks), "one pick per row of logits"
    return sampled, accepted
