"""`Drafter`: the decode lane's speculative decoding, one object the scheduler holds.

It asks for each decoder's drafts where the gate says a first one could pay: from the request's
prediction where it has one and the output is in step with it (`scheduler/prediction.py`), else
from the configured proposer (None: `--speculative none`, where only predictions draft); cuts
them to what the gate chooses, learns from each applied step (acceptances, and the step's time
for the gate's cost model), and counts what was drafted and accepted. The scheduler allocates
the slots and builds the chunks (`DisaggScheduler.schedule_decode`); see
`scheduler/speculative.py` for the proposers and the gate.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

from deepinfer.cache.manager import KVCacheManager
from deepinfer.outputs import RunnerOutput
from deepinfer.request import Request
from deepinfer.scheduler.cost_model import ChunkShape
from deepinfer.scheduler.draft_gate import Draft, DraftGate
from deepinfer.scheduler.output import ScheduledChunk, ScheduleOutput
from deepinfer.scheduler.prediction import PREDICTION_DRAFT_TOKENS, PredictionProposer
from deepinfer.scheduler.speculative import Proposer, SpeculativeCounts

PLAIN_STEPS_OBSERVED = 16
"""One decode step in this many without drafts feeds the gate's cost model (a fit is ~0.5 ms
on the loop; every step with drafts does)."""


LOOP_WINDOW = 64
"""Recent steps whose time outside the runner `LoopOverhead` takes the median of."""


class LoopOverhead:
    """Seconds a decode step spends outside its forward pass: scheduling it, applying its
    tokens, streaming them, and whatever else the loop does between two steps. Every step pays
    it, so a step that verifies drafts saves it along with the steps it saves; the gate counts
    it in a step's cost. Measured as the time from one step's planning to the next one's less
    the runner's time, the median of the last `LOOP_WINDOW` steps (a gap in which the lane sat
    idle, or ran prefill, is one outlier among them; each is capped at the step's own time)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._planned_at: float | None = None
        self._pending: tuple[float, float] | None = None
        """(planned at, runner seconds) of the last step applied."""
        self._recent: deque[float] = deque(maxlen=LOOP_WINDOW)
        self.seconds = 0.0

    def planned(self) -> None:
        """A step is being planned: the last one's loop time is known now."""
        now = self._clock()
        if self._pending is not None:
            start, runner_s = self._pending
            self._recent.append(min(max(now - start - runner_s, 0.0), runner_s))
            self.seconds = statistics.median(self._recent)
            self._pending = None
        self._planned_at = now

    def applied(self, runner_s: float) -> None:
        """The step planned last has run, in `runner_s` on the runner."""
        if self._planned_at is not None:
            self._pending = (self._planned_at, runner_s)
            self._planned_at = None


PROPOSE_S_WEIGHT = 0.1
"""How much each step's time per proposal moves `Drafter.propose_s`."""


class Drafter:
    def __init__(
        self,
        proposer: Proposer | None,
        gate: DraftGate,
        num_draft_tokens: int,
        loop: LoopOverhead | None = None,
    ) -> None:
        self.proposer = proposer
        self.predictions = PredictionProposer(gate.model.num_signals)
        self.gate = gate
        self.num_draft_tokens = num_draft_tokens
        self.loop = loop or LoopOverhead()
        self._drafted = self._accepted = self._verified = 0
        self._from_prediction: set[str] = set()
        """Requests whose drafts this step came from their prediction."""
        self._idle = False
        """The step planned last could not draft (no proposer, no prediction)."""
        self.propose_s = 0.0
        """Seconds one proposal takes on the loop (recency-weighted): the gate counts it in
        what a first draft costs."""

    def plan(self, decoding: Sequence[Request], max_tokens: int) -> dict[str, Draft]:
        """The drafts each decoder's next step verifies (`max_tokens`: the most a request may
        hold): the proposer's, cut by the gate; requests without drafts are left out."""
        self._idle = self.proposer is None and not any(r.predicted_token_ids for r in decoding)
        if self._idle:  # only predictions draft, and nobody has one: a plain step, unobserved
            return {}
        self.loop.planned()
        self.gate.loop_s = self.loop.seconds
        worth = self.gate.worth_proposing(decoding, self.propose_s)
        started = time.perf_counter()
        proposals = [
            self._propose(r, max_tokens) if w else Draft()
            for r, w in zip(decoding, worth, strict=True)
        ]
        if asked := sum(worth):
            per_proposal = (time.perf_counter() - started) / asked
            self.propose_s += PROPOSE_S_WEIGHT * (per_proposal - self.propose_s)
        if not any(d.size for d in proposals):
            return {}
        keep = self.gate.choose(list(zip(decoding, proposals, strict=True)))
        return {
            r.request_id: d.cut(k)
            for r, d, k in zip(decoding, proposals, keep, strict=True)
            if k > 0
        }

    def _propose(self, request: Request, max_tokens: int) -> Draft:
        self._from_prediction.discard(request.request_id)
        room = min(
            request.sampling.max_tokens - len(request.output_token_ids) - 1,
            max_tokens - request.num_tokens,
        )
        if room <= 0:
            return Draft()
        if request.predicted_token_ids:
            draft = self.predictions.propose(request, min(room, PREDICTION_DRAFT_TOKENS))
            if draft.size:
                self._from_prediction.add(request.request_id)
                return draft
        if self.proposer is None:
            return Draft()
        limit = self.proposer.max_draft_tokens or self.num_draft_tokens
        return self.proposer.propose(request, min(room, limit))

    def take_slots(
        self, kv: KVCacheManager, request: Request, draft: Draft, reserve_blocks: int
    ) -> bool:
        """Slots for a decoder's token and its drafts, leaving `reserve_blocks` free (a block
        for each request still to be scheduled: drafts never cost anyone a preemption); False,
        nothing allocated, when there is no such room."""
        n = 1 + draft.size
        if not kv.can_allocate(request, n, reserve_blocks=reserve_blocks):
            return False
        allocated = kv.allocate_slots(request, n)
        assert allocated, "can_allocate promised room"
        return True

    def observe_step(self, so: ScheduleOutput, out: RunnerOutput) -> None:
        """A decode step's cost (every step with drafts, one in PLAIN_STEPS_OBSERVED without,
        none while nothing could draft)."""
        if self._idle:
            return
        self.loop.applied(out.elapsed_s)
        if any(c.num_drafts for c in so.chunks) or so.step % PLAIN_STEPS_OBSERVED == 0:
            shapes = [ChunkShape(_computed(c, out), c.start_position) for c in so.chunks]
            self.gate.observe_cost(shapes, out.elapsed_s)

    def observe_request(self, request: Request, num_drafts: int, out: RunnerOutput) -> None:
        """How many of a request's `num_drafts` verified drafts the step accepted (none
        verified: a worker drafter made none, nothing to learn)."""
        if not num_drafts:
            return
        request_id = request.request_id
        accepted = len(out.accepted.get(request_id, ()))
        if request_id in self._from_prediction:
            request.num_accepted_prediction_tokens += accepted
        elif self.proposer is not None:
            self.proposer.observe(request_id, num_drafts, accepted)
        self._drafted += num_drafts
        self._verified += 1
        self._accepted += accepted
        self.gate.observe(request_id, num_drafts, accepted)

    def forget(self, request_id: str) -> None:
        self.gate.forget(request_id)
        self.predictions.forget(request_id)
        self._from_prediction.discard(request_id)
        if self.proposer is not None:
            self.proposer.forget(request_id)

    def counts(self) -> SpeculativeCounts:
        return SpeculativeCounts(
            self.proposer.name if self.proposer is not None else self.predictions.name,
            self._drafted,
            self._accepted,
            self._verified,
            self.gate.model.calibration(),
        )


def _computed(chunk: ScheduledChunk, out: RunnerOutput) -> int:
    """Tokens the step computed for a chunk: a worker drafter may have made fewer drafts than
    the chunk has slots for."""
    if not chunk.num_worker_drafts:
        return chunk.num_new_tokens
    made = out.drafted.get(chunk.request_id, chunk.num_worker_drafts)
    return chunk.num_new_tokens - chunk.num_worker_drafts + made
