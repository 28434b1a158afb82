"""Drafts from the model's multi-token-prediction layer (`--speculative mtp`, `model/mtp.py`),
made on the worker at the start of the step that verifies them, as a draft model's are
(`worker_draft.py`: the chunk's slots, the confidence cut, the catch-up budget, the KV in the
same blocks).

What differs is the input. The MTP layer's entry at position i takes the model's final hidden
state h_i and the next token x_{i+1}, and predicts x_{i+2}. So the runner hands over the hidden
states of every row each step computes (`record`), kept per request until the layer has used
them; a chunk whose last token x_s sits at position s drafts from the entry at s - 1 (h_{s-1},
x_s), after catching up every entry before it that is not in its KV yet, and each further draft
feeds the draft before it with the layer's own output in place of h. The entries at s and after
hold drafts' inputs: the layer's KV is valid before s alone, whatever verification accepts (the
next step recomputes those entries from the model's hidden states).

Whole blocks of the layer's KV are found by their tokens (`BlockKeys` with a shift of one: an
entry depends on the token after it), so a prompt prefix from the prefix cache whose entries an
earlier request computed is not computed again. A request whose positions lack both (a prefix
restored from the host or disk tier, or hidden states past `MAX_KEPT_POSITIONS` never used)
drafts nothing: only which tokens are tried depends on the layer, never the output."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.model.forward_batch import BatchChunk, build_forward_batch
from deepinfer.model.mtp import MTPHead
from deepinfer.runner.worker_draft import (
    CATCH_UP_TOKENS,
    DRAFT_CONFIDENCE_MIN,
    BlockKeys,
    Written,
    fill_drafts,
    greedy_picks,
)
from deepinfer.scheduler.output import ScheduledChunk, ScheduleOutput

MAX_KEPT_POSITIONS = 4096
"""Most positions of final hidden states kept per request for the MTP layer (the oldest go)."""


class _Kept:
    """A request's final hidden states not yet used by the MTP layer: contiguous positions, in
    the segments the steps computed (a step that starts before the end replaces what follows)."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, torch.Tensor]] = []

    def add(self, start: int, rows: torch.Tensor) -> None:
        kept = [(s, t[: start - s]) for s, t in self.segments if s < start]
        if kept and kept[-1][0] + len(kept[-1][1]) != start:
            kept = []  # positions computed elsewhere in between (a prefix hit)
        kept.append((start, rows))
        excess = sum(len(t) for _, t in kept) - MAX_KEPT_POSITIONS
        while excess > 0:
            s, t = kept[0]
            if len(t) <= excess:
                kept.pop(0)
                excess -= len(t)
            else:
                kept[0] = (s + excess, t[excess:])
                excess = 0
        self.segments = kept

    def rows(self, lo: int, hi: int) -> torch.Tensor | None:
        """The states of positions [lo, hi), None unless all are kept."""
        if not self.segments or self.segments[0][0] > lo:
            return None
        last_start, last = self.segments[-1]
        if last_start + len(last) < hi:
            return None
        parts = [t[max(lo - s, 0) : hi - s] for s, t in self.segments if s < hi and s + len(t) > lo]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def drop_before(self, position: int) -> None:
        self.segments = [
            (max(s, position), t[max(position - s, 0) :])
            for s, t in self.segments
            if s + len(t) > position
        ]


class MTPDrafter:
    keeps_hidden = True

    def __init__(
        self,
        head: MTPHead,
        block_size: int,
        device: torch.device,
        min_confidence: float = DRAFT_CONFIDENCE_MIN,
    ) -> None:
        self.head = head
        self.block_size = block_size
        self.device = device
        self.min_confidence = min_confidence
        self._kept: dict[str, _Kept] = {}
        self._written: dict[str, Written] = {}
        self._blocks = BlockKeys(block_size, shift=1)
        self.num_caught_up = 0
        """Entries computed to bring the layer's KV up to date (before the first passes)."""
        self.num_uncovered = 0
        """Chunks that asked for drafts and got none: their hidden states were not kept."""

    def record(self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor) -> None:
        offset = 0
        for c in chunks:
            n = c.num_new_tokens  # the chunk's rows: its tokens and drafts
            kept = self._kept.setdefault(c.request_id, _Kept())
            kept.add(c.start_position, hidden[offset : offset + n].clone())
            written = self._written.get(c.request_id)
            if written is not None:  # the entries before its start are in the layer's KV
                kept.drop_before(written.start - 1)
            offset += n

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget requests that finished or lost their blocks."""
        for rid in request_ids:
            self._written.pop(rid, None)
            self._kept.pop(rid, None)

    @torch.inference_mode()
    def fill(self, so: ScheduleOutput) -> tuple[ScheduleOutput, dict[str, int]]:
        """`so` with every chunk's worker drafts made, and how many each got."""
        self.release(so.preempted_ids)
        return fill_drafts(so, self._draft)

    def _draft(self, wanting: list[ScheduledChunk]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {c.request_id: [] for c in wanting}
        ready, batch, previous = self._first_pass(wanting)
        fed: dict[str, tuple[int, torch.Tensor]] = {}
        """Each request still drafting: its last pick and the layer's output that chose it."""
        for c, pick in zip(ready, self._passes(ready, batch, previous), strict=True):
            self._take(c, pick, drafts, fed)
        for j in range(1, max(c.num_worker_drafts for c in wanting)):
            active = [c for c in ready if c.request_id in fed and c.num_worker_drafts > j]
            if not active:
                break
            inputs = [fed.pop(c.request_id) for c in active]
            batch = [
                BatchChunk([token], c.start_position - 1 + j, c.block_ids)
                for c, (token, _) in zip(active, inputs, strict=True)
            ]
            passes = self._passes(active, batch, [h for _, h in inputs])
            for c, pick in zip(active, passes, strict=True):
                self._take(c, pick, drafts, fed)
        for c in ready:
            picks, start = drafts[c.request_id], c.start_position
            self._written[c.request_id] = Written(start, 0, c.block_ids)
            self._blocks.overwritten(c.block_ids, start, start + len(picks) - 1)
            if c.request_id not in fed:  # its last pick was not sure
                picks.pop()
        return drafts

    @staticmethod
    def _take(
        chunk: ScheduledChunk,
        pick: tuple[int, bool, torch.Tensor],
        drafts: dict[str, list[int]],
        fed: dict[str, tuple[int, torch.Tensor]],
    ) -> None:
        token, sure, out = pick
        drafts[chunk.request_id].append(token)
        if sure:
            fed[chunk.request_id] = (token, out)

    def _first_pass(
        self, wanting: list[ScheduledChunk]
    ) -> tuple[list[ScheduledChunk], list[BatchChunk], list[torch.Tensor]]:
        """The chunks that draft this step, and the first pass's batch and hidden states: each
        one's entries to catch up and the one at its start - 1, then the catch-up of requests
        still behind."""
        budget = CATCH_UP_TOKENS
        ready: list[ScheduledChunk] = []
        batch: list[BatchChunk] = []
        previous: list[torch.Tensor] = []
        behind: list[tuple[BatchChunk, torch.Tensor]] = []
        for c in wanting:
            rid, end = c.request_id, c.start_position
            start = min(self._valid_until(c), end - 1)
            kept = self._kept.get(rid)
            if kept is None:
                self.num_uncovered += 1
                continue
            kept.drop_before(start)
            rows = kept.rows(start, end)
            if rows is None:
                self.num_uncovered += 1
                continue
            lag = end - 1 - start  # entries before the one the first draft comes from
            if lag <= budget:
                budget -= lag
                self.num_caught_up += lag
                ready.append(c)
                batch.append(
                    BatchChunk(c.request.token_span(start + 1, end + 1), start, c.block_ids)
                )
                previous.append(rows)
                if lag >= self.block_size:
                    self._blocks.computed(c, end)
            elif budget > 0:
                stop = start + budget
                self.num_caught_up += budget
                budget = 0
                tokens = c.request.token_span(start + 1, stop + 1)
                chunk = BatchChunk(tokens, start, c.block_ids, sample=False)
                behind.append((chunk, rows[: stop - start]))
                self._written[rid] = Written(stop, 0, c.block_ids)
                self._blocks.computed(c, stop)
        return (
            ready,
            batch + [b for b, _ in behind],
            previous + [rows for _, rows in behind],
        )

    def _passes(
        self, chunks: list[ScheduledChunk], batch: list[BatchChunk], previous: list[torch.Tensor]
    ) -> list[tuple[int, bool, torch.Tensor]]:
        """One pass of the layer over `batch` (hidden states `previous`, row for row): the pick
        after each sampling chunk (one per entry of `chunks`, in order), whether the layer is
        sure of it, and the layer's output there."""
        if not batch:
            return []
        forward = build_forward_batch(batch, self.block_size, self.device)
        out = self.head.forward_hidden(forward, torch.cat(previous))
        if not chunks:
            return []
        last = out[forward.logits_indices]  # [B, hidden]
        picks = greedy_picks(self.head.compute_logits(last), self.min_confidence)
        return [(t, s, last[i : i + 1]) for i, (t, s) in enumerate(picks)]

    def _valid_until(self, chunk: ScheduledChunk) -> int:
        """Where the layer's valid KV of the chunk's request ends."""
        written = self._written.get(chunk.request_id)
        own = 0 if written is None else written.valid_until(chunk, self.block_size)
        if chunk.start_position - own < self.block_size:
            return own
        return max(own, self._blocks.valid_prefix(chunk))
