"""Prompt logprobs: each prompt token's log-probability given the tokens before it, gathered
over a prompt's chunks and handed out with the request's first sampled token.

A chunk of a request that needs them (`Request.needs_prompt_logits`) asks the model for extra
rows of hidden states (`ScheduledChunk.num_prompt_logits`, after the step's sampling rows in
`logits_indices`); only those requests pay for them. Their logits are made in slices of
`SLICE_ROWS` rows, so a long chunk never holds more than one slice's `[rows, V]` float32 logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from deepinfer.outputs import PromptLogprob
from deepinfer.scheduler.output import ScheduledChunk

SLICE_ROWS = 256
"""Prompt positions whose logits are made at once (256 x a 128k vocabulary: 128 MiB)."""


class PromptLogprobTable:
    """The prompt logprobs gathered so far per request, from position 1 on.

    Invariant: a request's entries are those of prompt tokens `1 .. len(entries)`; a chunk
    starting earlier (recomputation after preemption) replaces those from its start.
    """

    def __init__(self) -> None:
        self._entries: dict[str, list[PromptLogprob]] = {}

    def add(
        self,
        chunks: Sequence[ScheduledChunk],
        hidden: torch.Tensor,  # [P, hidden]: the chunks' prompt rows, in order
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Score the prompt rows of a step's `chunks` and append them to their requests'."""
        wanted = [c for c in chunks if c.num_prompt_logits]
        targets: list[int] = []
        for c in wanted:
            start = c.start_position
            targets.extend(c.request.token_span(start + 1, start + 1 + c.num_prompt_logits))
        num_top = max(c.request.sampling.prompt_logprobs or 0 for c in wanted)
        scored = score_rows(hidden, targets, num_top, compute_logits)
        i = 0
        for c in wanted:
            rid, n = c.request_id, c.num_prompt_logits
            entries = self._entries.setdefault(rid, [])
            assert c.start_position <= len(entries), "a prompt chunk skipped positions"
            del entries[c.start_position :]
            k = c.request.sampling.prompt_logprobs or 0
            entries.extend(_top(e, k) for e in scored[i : i + n])
            i += n

    def take(self, chunks: Sequence[ScheduledChunk]) -> dict[str, tuple[PromptLogprob, ...]]:
        """The whole prompt's entries of each request whose first token `chunks` sample."""
        out: dict[str, tuple[PromptLogprob, ...]] = {}
        for c in chunks:
            if c.sample and c.request.needs_prompt_logits:
                entries = self._entries.pop(c.request_id, [])
                assert len(entries) == c.request.num_prompt_tokens - 1, "prompt rows missing"
                out[c.request_id] = tuple(entries)
        return out

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._entries.pop(rid, None)


def score_rows(
    hidden: torch.Tensor,  # [P, hidden]
    targets: Sequence[int],
    num_top: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> list[PromptLogprob]:
    """Row i's logprob of `targets[i]`, its rank and the `num_top` most likely tokens, from
    `log_softmax` of the logits `compute_logits` makes of `hidden` (one slice at a time)."""
    out: list[PromptLogprob] = []
    target_ids = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
    for lo in range(0, len(targets), SLICE_ROWS):
        hi = min(lo + SLICE_ROWS, len(targets))
        logprobs = torch.log_softmax(compute_logits(hidden[lo:hi]).float(), dim=1)  # [S, V]
        chosen = logprobs.gather(1, target_ids[lo:hi].unsqueeze(1))  # [S, 1]
        ranks = (logprobs > chosen).sum(dim=1) + 1  # [S]
        top_ids: list[list[int]] = [[] for _ in range(hi - lo)]
        top_lps: list[list[float]] = [[] for _ in range(hi - lo)]
        if num_top:
            top = logprobs.topk(min(num_top, logprobs.shape[1]), dim=1)  # [S, k]
            top_ids, top_lps = top.indices.tolist(), top.values.tolist()
        for j, (lp, rank) in enumerate(
            zip(chosen.squeeze(1).tolist(), ranks.tolist(), strict=True)
        ):
            pairs = tuple(zip(top_ids[j], top_lps[j], strict=True))
            out.append(PromptLogprob(targets[lo + j], lp, rank, pairs))
    return out


def _top(entry: PromptLogprob, k: int) -> PromptLogprob:
    """`entry` with its request's own number of alternatives (the step scored the most any
    request of it asked for)."""
    if len(entry.top_logprobs) <= k:
        return entry
    return PromptLogprob(entry.token_id, entry.logprob, entry.rank, entry.top_logprobs[:k])
