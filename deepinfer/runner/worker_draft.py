"""Drafts made on the worker at the start of the step that verifies them: self-speculation
(`--speculative layers`: the model's own first `num_layers` layers, its final norm and LM head)
and a draft model (`--speculative draft-model`: a smaller model with the same vocabulary).

A decode chunk that asks for k drafts (`ScheduledChunk.num_worker_drafts`) has slots for its last
token and k more. The drafter runs up to k greedy passes over every such chunk at once, each
feeding the token before (the last token, then each draft) at its position. With the gate on,
it stops a request's drafting at the first pick whose probability under the draft is below
`DRAFT_CONFIDENCE_MIN` (that pick is not drafted): a draft the drafter itself doubts is a
verification row likely wasted (with `--speculative-gate off` every slot gets its draft). The chunk goes to verification with the drafts made, maybe
fewer than its slots (`num_new_tokens` shrinks with them; the unused slots roll back as a
rejected draft's do), and the runner reports how many (`RunnerOutput.drafted`).

KV. Self-speculation's layers are the model's: the KV of every position before the chunk is
already theirs, and a pass writes its layers' KV at the drafted positions, which verification
then writes again, all layers, in the same slots. A draft model writes KV of its own, in its own
caches at the same slots (`engine/build_replicas.py`: one block holds both models' KV), and
keeps it in step lazily: it remembers, per request, from which position its last passes wrote
and how many; at the next step the positions the request kept (its last token and the accepted
drafts) are valid, and everything after them up to the chunk, the "catch-up" (the prompt, at
first, and any steps decoded without drafts), is computed as one prefill chunk ending in the
first pass, `CATCH_UP_TOKENS` a step at most across requests (a request still catching up
drafts nothing that step). Whole blocks of the draft's KV are found by their tokens too
(`BlockKeys`): a prompt prefix that another request's draft computed, in blocks the prefix
cache shares, is not computed again. A request preempted or finished is forgotten (and one whose blocks
are not those its draft KV was written in starts over). Whatever the draft's
KV holds, only which tokens are tried depends on it: outputs are verification's alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec
import torch

from deepinfer.kernels.native.greedy import greedy_ids
from deepinfer.model.forward_batch import BatchChunk, build_forward_batch
from deepinfer.model.protocol import CausalLM
from deepinfer.scheduler.output import ScheduledChunk, ScheduleOutput

DRAFT_CONFIDENCE_MIN = 0.4
"""A draft whose probability under the drafter is below this ends the request's drafts."""

CATCH_UP_TOKENS = 256
"""Most tokens a draft model computes in one step to bring requests' draft KV up to date."""


@dataclasses.dataclass(frozen=True)
class Written:
    """A draft model's KV of a request: valid before `start`; its last passes wrote `count`
    positions from `start`, the first with the request's token there, the others with drafts,
    in the blocks `block_ids`."""

    start: int
    count: int
    block_ids: tuple[int, ...]

    def valid_until(self, chunk: ScheduledChunk, block_size: int) -> int:
        """Where valid KV ends for the chunk, the request's next (0 when its blocks are not
        those written: the request lost its blocks since)."""
        position = chunk.start_position
        if position < self.start:
            return 0
        valid = self.start + min(position - self.start, self.count)
        n = -(-valid // block_size)
        return valid if chunk.block_ids[:n] == self.block_ids[:n] else 0


class BlockKeys:
    """Which blocks hold a draft's KV of which tokens: a full block's key chains its tokens
    with every earlier block's (as the prefix cache's hashes do), set when the draft computed
    the whole block and dropped when it writes there again. A request whose blocks carry the
    keys of its own tokens finds the draft's KV there, whoever computed it: a prefix served
    from the prefix cache is not computed again by the draft either. With `shift`, a
    position's KV depends on the tokens up to `shift` after it (an MTP layer's, on the next
    token): a block's key chains those."""

    def __init__(self, block_size: int, shift: int = 0) -> None:
        self.block_size = block_size
        self.shift = shift
        self._keys: dict[int, int] = {}

    def _chain(self, tokens: Sequence[int], num_blocks: int) -> list[int]:
        bs, shift, keys = self.block_size, self.shift, []
        key = hash(tuple(tokens[:shift]))
        for i in range(num_blocks):
            key = hash((key, tuple(tokens[i * bs + shift : (i + 1) * bs + shift])))
            keys.append(key)
        return keys

    def valid_prefix(self, chunk: ScheduledChunk) -> int:
        """Positions from 0 whose draft KV the chunk's blocks hold (whole blocks, before the
        chunk's start)."""
        n = chunk.start_position // self.block_size
        keys = self._chain(chunk.request.all_token_ids, n)
        valid = 0
        for block_id, key in zip(chunk.block_ids, keys, strict=False):
            if self._keys.get(block_id) != key:
                break
            valid += self.block_size
        return valid

    def computed(self, chunk: ScheduledChunk, end: int) -> None:
        """The draft's KV of the chunk's request is valid before `end`: its full blocks there
        get their keys."""
        n = end // self.block_size
        keys = self._chain(chunk.request.all_token_ids, n)
        self._keys.update(zip(chunk.block_ids[:n], keys, strict=True))

    def overwritten(self, block_ids: Sequence[int], start: int, end: int) -> None:
        """The draft wrote other tokens' KV (drafts) at positions [start, end)."""
        bs = self.block_size
        for i in range(start // bs, -(-end // bs)):
            self._keys.pop(block_ids[i], None)


class Drafter(Protocol):
    """Makes the worker's drafts of a step before its forward pass (`WorkerDrafter`,
    `worker_mtp.MTPDrafter`)."""

    keeps_hidden: bool
    """Wants the model's final hidden state of every row each step computes (`record`)."""
    num_caught_up: int
    min_confidence: float
    """The draft probability below which a request's drafting stops (0: never)."""

    def fill(self, so: ScheduleOutput) -> tuple[ScheduleOutput, dict[str, int]]: ...

    def release(self, request_ids: Sequence[str]) -> None: ...

    def record(self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor) -> None:
        """The final (normed) hidden states `[T, hidden]` of a step's rows: `chunks`' tokens,
        in order."""
        ...


class WorkerDrafter:
    keeps_hidden = False

    def __init__(
        self,
        model: CausalLM,
        block_size: int,
        device: torch.device,
        num_layers: int | None = None,
        min_confidence: float = DRAFT_CONFIDENCE_MIN,
    ) -> None:
        """`num_layers`: self-speculation with the model's first layers; None: `model` is a
        draft model with KV caches of its own. `min_confidence`: the draft probability below
        which a request's drafting stops (0: never)."""
        if num_layers is not None and not 1 <= num_layers < model.arch.num_layers:
            raise ValueError(
                f"draft_layers must be in [1, {model.arch.num_layers - 1}] for this model "
                f"({model.arch.num_layers} layers), got {num_layers}"
            )
        self.model = model
        self.num_layers = num_layers
        self.min_confidence = min_confidence
        self.block_size = block_size
        self.device = device
        self._written: dict[str, Written] = {}
        """A draft model's KV per request (self-speculation needs none)."""
        self._blocks = BlockKeys(block_size)
        self.num_caught_up = 0
        """Tokens a draft model computed to bring its KV up to date (before the first passes)."""

    @torch.inference_mode()
    def fill(self, so: ScheduleOutput) -> tuple[ScheduleOutput, dict[str, int]]:
        """`so` with every chunk's worker drafts made (`draft_token_ids`), and how many each
        got; `so` itself when no chunk asks for any."""
        self.release(so.preempted_ids)
        return fill_drafts(so, self._draft)

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget requests that finished or lost their blocks."""
        for rid in request_ids:
            self._written.pop(rid, None)

    def record(self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor) -> None:
        pass

    def _draft(self, wanting: list[ScheduledChunk]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {c.request_id: [] for c in wanting}
        first, catching_up = self._first_pass(wanting)
        fed: dict[str, int] = {}
        for c, (token_id, sure) in zip(first, self._picks(first, catching_up), strict=True):
            drafts[c.request_id].append(token_id)
            if sure:
                fed[c.request_id] = token_id
        for j in range(1, max(c.num_worker_drafts for c in wanting)):
            active = [c for c in first if c.request_id in fed and c.num_worker_drafts > j]
            if not active:
                break
            batch = [
                BatchChunk([fed.pop(c.request_id)], c.start_position + j, c.block_ids)
                for c in active
            ]
            for c, (token_id, sure) in zip(active, self._picks(active, batch), strict=True):
                drafts[c.request_id].append(token_id)
                if sure:
                    fed[c.request_id] = token_id
        for c in first:
            picks = drafts[c.request_id]
            self._remember(c, len(picks))  # each pick's pass wrote the position before it
            if c.request_id not in fed:  # its last pick was not sure
                picks.pop()
        return drafts

    def _first_pass(
        self, wanting: list[ScheduledChunk]
    ) -> tuple[list[ScheduledChunk], list[BatchChunk]]:
        """The chunks that draft this step, and the first pass's batch: theirs (catch-up and
        the last token, or the last token alone), then those of requests still catching up."""
        budget = CATCH_UP_TOKENS
        ready: list[ScheduledChunk] = []
        batch: list[BatchChunk] = []
        behind: list[BatchChunk] = []
        for c in wanting:
            start = self._valid_until(c)
            lag = c.start_position - start
            if lag <= budget:
                budget -= lag
                self.num_caught_up += lag
                ready.append(c)
                tokens = c.request.token_span(start, c.start_position + 1)
                batch.append(BatchChunk(tokens, start, c.block_ids))
                if lag >= self.block_size:
                    self._blocks.computed(c, c.start_position + 1)
            elif budget > 0:
                end = start + budget
                self.num_caught_up += budget
                budget = 0
                tokens = c.request.token_span(start, end)
                behind.append(BatchChunk(tokens, start, c.block_ids, sample=False))
                self._written[c.request_id] = Written(end, 0, c.block_ids)
                self._blocks.computed(c, end)
        return ready, batch + behind

    def _picks(
        self, chunks: list[ScheduledChunk], batch: list[BatchChunk]
    ) -> list[tuple[int, bool]]:
        """The draft's greedy pick after each sampling chunk of `batch` (in order, one per
        entry of `chunks`) and whether the draft is sure of it."""
        if not batch:
            return []
        forward = build_forward_batch(batch, self.block_size, self.device)
        hidden = self.model.forward_hidden(forward, self.num_layers)
        if not chunks:
            return []
        return greedy_picks(self.model.compute_logits(hidden), self.min_confidence)

    def _valid_until(self, chunk: ScheduledChunk) -> int:
        """Where the drafter's valid KV of the chunk's request ends (the chunk's start for
        self-speculation: the model's own KV is the draft's)."""
        if self.num_layers is not None:
            return chunk.start_position
        written = self._written.get(chunk.request_id)
        own = 0 if written is None else written.valid_until(chunk, self.block_size)
        if chunk.start_position - own < self.block_size:
            return own
        return max(own, self._blocks.valid_prefix(chunk))

    def _remember(self, chunk: ScheduledChunk, count: int) -> None:
        """After the passes of a chunk that drafted: `count` positions from its start were
        written, the first with its token (its KV is valid up to it), the others with drafts."""
        if self.num_layers is None:
            start = chunk.start_position
            self._written[chunk.request_id] = Written(start, count, chunk.block_ids)
            self._blocks.overwritten(chunk.block_ids, start + 1, start + count)


def fill_drafts(
    so: ScheduleOutput, draft: Callable[[list[ScheduledChunk]], dict[str, list[int]]]
) -> tuple[ScheduleOutput, dict[str, int]]:
    """`so` with the drafts `draft` makes for the chunks that ask for them, and how many each
    got; `so` itself when no chunk asks."""
    wanting = [c for c in so.chunks if c.num_worker_drafts]
    if not wanting:
        return so, {}
    drafts = draft(wanting)
    chunks = tuple(
        with_drafts(c, drafts[c.request_id]) if c.num_worker_drafts else c for c in so.chunks
    )
    return msgspec.structs.replace(so, chunks=chunks), {rid: len(d) for rid, d in drafts.items()}


def greedy_picks(logits: torch.Tensor, min_confidence: float) -> list[tuple[int, bool]]:
    """Each row's greedy pick and whether its probability is at least `min_confidence` (0:
    always sure)."""
    ids = greedy_ids(logits).clamp(min=0)  # a row with no finite logit drafts token 0
    if min_confidence <= 0:
        return [(i, True) for i in ids.tolist()]
    top = logits.gather(1, ids.unsqueeze(1)).squeeze(1)
    prob = torch.exp(top - torch.logsumexp(logits, dim=-1))  # the pick's probability
    sure = prob >= min_confidence  # NaN: never
    return list(zip(ids.tolist(), sure.tolist(), strict=True))


def with_drafts(chunk: ScheduledChunk, drafts: list[int]) -> ScheduledChunk:
    return dataclasses.replace(
        chunk,
        draft_token_ids=tuple(drafts),
        num_worker_drafts=0,
        num_new_tokens=1 + len(drafts),
    )
