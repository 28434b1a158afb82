"""Verifying a step's draft tokens against the model's own picks (speculative decoding).

A chunk with drafts d_1..d_k computed the request's last token and the drafts; its k + 1 rows of
logits gave the model's picks t_1..t_{k+1}, each made by the sampler exactly as a plain step at
that position would make it: the same processed logits (row j sees the outputs and d_1..d_{j-1},
for penalties and `min_tokens`) and, for a sampled request, the same random number (the j-th
draw from the request's generator, the one plain decoding would use for that position). Draft
d_j is accepted while every d_i = t_i for i <= j; the request's new tokens are t_1..t_{a+1} for
`a` accepted drafts: exactly the tokens plain decoding picks one step at a time, since each t_i
was computed after the same tokens with the same number. Lossless whatever the sampling: greedy
gives the plain tokens, and a seeded request gives its plain tokens too.

For a sampled request this is rejection sampling with the draft's own distribution a point mass
(prompt lookup): d_j survives with probability p_j(d_j), and when it does not, t_j follows p_j
with d_j taken out, renormalized; both from the one inverse-CDF draw. The numbers drawn for
positions after the first rejection are given back (`DrawnStreams`): the generator ends where
plain decoding's would, so the request's later tokens stay the plain ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from deepinfer.outputs import SampledToken
from deepinfer.sampling.generators import draw_one
from deepinfer.scheduler.output import ScheduledChunk


def verify_drafts(
    chunks: Sequence[ScheduledChunk], picks: Sequence[SampledToken]
) -> tuple[dict[str, SampledToken], dict[str, tuple[SampledToken, ...]]]:
    """(first token, the tokens after it) of every sampling chunk, from the picks of their
    logits rows in order (`ScheduledChunk.num_logits` rows each)."""
    if len(picks) == len(chunks) and all(c.sample and not c.num_drafts for c in chunks):
        return {c.request.request_id: pick for c, pick in zip(chunks, picks, strict=True)}, {}
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


class DrawnStreams:
    """The generator states of a step's requests that verify drafts, saved before sampling so
    the draws of the rows not kept can be given back."""

    def __init__(self, saved: dict[str, tuple[torch.Generator, torch.Tensor, int]]) -> None:
        self._saved = saved
        """request id -> (generator, its state before the step, rows it drew for)."""

    @classmethod
    def save(
        cls, chunks: Sequence[ScheduledChunk], generators: Mapping[str, torch.Generator]
    ) -> DrawnStreams:
        saved = {
            c.request_id: (g, g.get_state(), c.num_logits)
            for c in chunks
            if c.sample and c.draft_token_ids and (g := generators.get(c.request_id)) is not None
        }
        return cls(saved)

    def keep_used(self, accepted: Mapping[str, Sequence[SampledToken]]) -> None:
        """Rewind each generator to after the draws of the rows whose picks were kept (the
        first, and one per accepted draft)."""
        for request_id, (generator, state, drawn) in self._saved.items():
            used = 1 + len(accepted.get(request_id, ()))
            if used < drawn:
                generator.set_state(state)
                for _ in range(used):
                    draw_one(generator)
