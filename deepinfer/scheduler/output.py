"""`ScheduleOutput`: the scheduler's one message per step, and the runner's only input."""

from __future__ import annotations

import enum

import msgspec

from deepinfer.message import message
from deepinfer.request import Request


class StepKind(enum.Enum):
    """Which worker a step belongs to (each runs its own steps, one at a time)."""

    MIXED = "mixed"
    """Colocated mode: decodes and prefill chunks share one step and one token budget."""
    PREFILL = "prefill"
    DECODE = "decode"


@message
class ScheduledChunk:
    """Compute `num_new_tokens` tokens of one request, starting at `start_position`.

    The tokens are `request.all_token_ids[start_position : start_position + num_new_tokens]`.
    A decode is a one-token chunk. Positions before `start_position` already have KV in
    `block_ids` (computed earlier or served from the prefix cache).
    """

    request: Request
    start_position: int
    num_new_tokens: int
    block_ids: tuple[int, ...]
    """The request's whole block table, long enough for start_position + num_new_tokens."""
    sample: bool
    """True when the chunk reaches the request's last known token: sample the next one."""
    draft_token_ids: tuple[int, ...] = ()
    """Speculative decoding (a decode chunk): proposed tokens after the request's last one,
    computed in the same chunk (`num_new_tokens` counts them) and verified against the model's
    own picks; only the agreed ones become the request's tokens."""
    num_worker_drafts: int = 0
    """Drafts the runner makes at the start of the step (a model proposer), with slots here;
    the runner verifies the chunk with them as `draft_token_ids`."""
    window_block_ids: tuple[int, ...] = ()
    """A model with sliding-window layers: their block table (block 0 where the window no
    longer reaches); empty: every layer uses `block_ids`."""
    cached_until: int = 0
    """Positions before this already have the full layers' K/V, cached: the chunk recomputes
    them for the windowed layers only (a prefix hit's replay) and does not rewrite it."""

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids) + self.num_worker_drafts

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def end_position(self) -> int:
        return self.start_position + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        """One token (and its drafts) after the prompt's whole context was computed (else
        prompt work: a prefill chunk, or recomputation after preemption)."""
        request = self.request
        one = self.num_new_tokens - self.num_drafts == 1
        return one and self.start_position >= request.num_prompt_tokens

    @property
    def num_logits(self) -> int:
        """Rows of logits the chunk needs: its last token's, or with drafts one per position."""
        return 1 + self.num_drafts if self.sample else 0

    @property
    def num_prompt_logits(self) -> int:
        """Rows of prompt logits the chunk computes besides its sampling rows: for a request
        that needs them (`Request.needs_prompt_logits`), one per position whose next token is
        a prompt token (0 for every other request, at the cost of one attribute test)."""
        request = self.request
        if not request.needs_prompt_logits:
            return 0
        end = min(self.end_position, request.num_prompt_tokens - 1)
        return max(end - self.start_position, 0)

    def token_ids(self) -> list[int]:
        if self.draft_token_ids:
            start = self.start_position
            return [*self.request.token_span(start, start + 1), *self.draft_token_ids]
        return self.request.token_span(self.start_position, self.end_position)


class ScheduleOutput(msgspec.Struct, frozen=True):
    """One step's plan, from the loop to a worker's thread (`Struct`: a message between threads,
    immutable and cheap to build)."""

    step: int
    chunks: tuple[ScheduledChunk, ...]
    """Decodes first, then prefill chunks; at most one chunk per request."""
    preempted_ids: tuple[str, ...] = ()
    """Requests whose blocks were freed this step; they recompute on readmission."""
    kind: StepKind = StepKind.MIXED
    predicted_s: float | None = None
    """The prefill cost model's prediction for this step (prefill steps only)."""
    plain_decodes: bool = False
    """Every chunk is a plain decode: one token, the request's last, sampled; no drafts, one
    KV pool, nothing cached ahead (the decode lane's common step: the runner builds it from
    its requests alone, without asking each chunk)."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class KVHandoff(msgspec.Struct, frozen=True):
    """Copy a prefilled request's KV from the prefill pool to the decode pool (separate device
    groups): `src_block_ids[i]` of the prefill caches into `dst_block_ids[i]` of the decode
    caches. The decode lane admits the request when `DisaggScheduler.complete_handoff` says the
    copy is done; until then no step reads or writes either side's blocks."""

    request_id: str
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
