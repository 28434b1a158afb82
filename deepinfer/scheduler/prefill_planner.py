"""`PrefillPlanner`: length-bucketed, time-budgeted prefill planning with a learned cost model.

Each `plan()` picks prefill chunks whose predicted time (by `StepCostModel`) fits the step budget:

1. Backstop: a non-empty bucket not served for `max_wait_steps` steps gets one aligned chunk
   first, whatever it costs (also when nothing at all would fit the budget).
2. Guaranteed shares: the non-empty buckets split the step's work budget (the budget less the
   step overhead), token cap and request slots by `bucket_weights`; shortest bucket first, each
   serves its FIFO queue within its share. Shares of non-empty buckets sum to one, so every
   bucket's share is there for it whatever the buckets before it did: no bucket starves.
3. Work conservation: what is left goes to the buckets again, shortest first.

Consequences the tests check: while the short bucket's queued work fits its share (at least
half the step with the default weights, whatever else waits), a short prompt is planned in full
in the step right after it arrives, never behind long work (the short bucket comes first in both
passes and long buckets only ever hold their share); beyond that, shorts and longs split steps by
weight. Every bucket with work gets a chunk every step while one aligned chunk fits its share
(the backstop covers the rest); a long prompt progresses by its share every step under any
flood of short ones; within a bucket, requests finish in arrival order; chunks that do not
finish their request end on a multiple of `chunk_align_tokens`; the plan's predicted time stays
within the budget unless the plan says `forced`.

A plan is committed when made: queued requests advance by their chunks and leave once their
prefill is planned in full. The caller runs the plan, then reports its time with `observe()`,
which trains the cost model. Pure and synchronous: no clock, no threads, no torch.
"""

from __future__ import annotations

import math

from deepinfer.errors import InvalidRequestError
from deepinfer.scheduler.buckets import BucketQueues, LengthBuckets, PrefillEntry
from deepinfer.scheduler.cost_model import StepCostModel
from deepinfer.scheduler.prefill_types import (
    PlannedChunk,
    PlannerStats,
    PrefillPlan,
    PrefillPlannerConfig,
    PrefillSource,
)

_OVER_BUDGET_FACTOR = 1.2


class _StepDraft:
    """The chunks of the step being planned: new tokens per request and their marginal cost."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[PrefillEntry, int]] = {}
        self.spent_s = 0.0
        self.num_tokens = 0

    @property
    def num_seqs(self) -> int:
        return len(self.entries)

    def tokens_of(self, entry: PrefillEntry) -> int:
        return self.entries.get(entry.request_id, (entry, 0))[1]

    def set(self, entry: PrefillEntry, num_new_tokens: int, extra_s: float) -> None:
        self.num_tokens += num_new_tokens - self.tokens_of(entry)
        self.entries[entry.request_id] = (entry, num_new_tokens)
        self.spent_s += extra_s


class PrefillPlanner:
    def __init__(self, config: PrefillPlannerConfig, cost_model: StepCostModel) -> None:
        self.config = config
        self.budget_s = config.step_budget_s
        self.buckets = LengthBuckets(config.boundaries)
        self.cost_model = cost_model
        self._queues = BucketQueues(self.buckets.num_buckets)
        self._waiting_since = [0] * self.buckets.num_buckets
        """Per bucket: the last step that served it, or that it became non-empty at."""
        self._step = 0
        self._num_observed = 0
        self._sum_rel_error = 0.0
        self._num_over_budget = 0
        self._last: tuple[float, float] = (math.nan, math.nan)

    def __len__(self) -> int:
        return len(self._queues)

    @property
    def has_work(self) -> bool:
        return len(self._queues) > 0

    @property
    def step(self) -> int:
        """Number of plans made so far."""
        return self._step

    def add(self, request: PrefillSource) -> int:
        """Queue a request's prefill; returns its bucket. Raises `InvalidRequestError` for a
        duplicate id or a request with nothing to compute."""
        rid, num_tokens, num_computed = (
            request.request_id,
            request.num_tokens,
            request.num_computed_tokens,
        )
        if rid in self._queues:
            raise InvalidRequestError(f"request id {rid!r} is already queued for prefill")
        if not 0 <= num_computed < num_tokens:
            raise InvalidRequestError(
                f"request {rid!r} has no prefill to plan: {num_computed} of {num_tokens} "
                "tokens computed"
            )
        bucket = self.buckets.index(num_tokens - num_computed)
        if self._queues.is_empty(bucket):
            self._waiting_since[bucket] = self._step
        self._queues.push(PrefillEntry(rid, num_tokens, num_computed, bucket, self._step))
        return bucket

    def queued_ids(self) -> set[str]:
        """Requests with prefill chunks still to plan."""
        return self._queues.ids()

    def remove(self, request_id: str) -> bool:
        """Drop a queued request (abort, preemption). False if it is not queued."""
        return self._queues.pop(request_id) is not None

    def plan(self) -> PrefillPlan:
        """Choose and commit the next step's chunks (see the module docstring for the rules)."""
        self._step += 1
        draft = _StepDraft()
        nonempty = [i for i in range(self.buckets.num_buckets) if not self._queues.is_empty(i)]
        forced = self._serve_starving(draft, nonempty)
        cfg = self.config
        work_s = max(self.budget_s - self.cost_model.step_overhead_s, 0.0)
        total_weight = sum(cfg.bucket_weights[i] for i in nonempty)
        for k, i in enumerate(nonempty):
            share = cfg.bucket_weights[i] / total_weight
            self._fill(
                draft,
                i,
                time_s=min(share * work_s, work_s - draft.spent_s),
                num_tokens=min(int(share * cfg.max_num_batched_tokens), self._tokens_left(draft)),
                num_seqs=self._seqs_share(draft, later=len(nonempty) - k - 1),
            )
        for i in nonempty:
            self._fill(
                draft,
                i,
                time_s=work_s - draft.spent_s,
                num_tokens=self._tokens_left(draft),
                num_seqs=cfg.max_num_seqs - draft.num_seqs,
            )
        if nonempty and not draft.entries:
            oldest = min(nonempty, key=lambda i: (self._waiting_since[i], i))
            self._force_unit(draft, oldest)
            forced = True
        return self._commit(draft, forced)

    def observe(self, plan: PrefillPlan, measured_s: float) -> None:
        """Report how long `plan` took to run; trains the cost model and the stats."""
        if plan.is_empty or not math.isfinite(measured_s) or measured_s <= 0:
            return
        self.cost_model.observe(plan.shapes, measured_s)
        self._num_observed += 1
        self._sum_rel_error += abs(plan.predicted_s - measured_s) / measured_s
        self._num_over_budget += measured_s > plan.budget_s * _OVER_BUDGET_FACTOR
        self._last = (plan.predicted_s, measured_s)

    def stats(self) -> PlannerStats:
        heads = [self._queues.head(i) for i in range(self.buckets.num_buckets)]
        return PlannerStats(
            step=self._step,
            bucket_labels=tuple(self.buckets.label(i) for i in range(self.buckets.num_buckets)),
            queue_depths=self._queues.depths(),
            queued_tokens=self._queues.queued_tokens(),
            head_wait_steps=tuple(
                self._step - h.added_step if h is not None and h.first_planned_step < 0 else 0
                for h in heads
            ),
            num_steps_observed=self._num_observed,
            last_predicted_s=self._last[0],
            last_measured_s=self._last[1],
            mean_abs_rel_error=(
                self._sum_rel_error / self._num_observed if self._num_observed else math.nan
            ),
            num_steps_over_budget=self._num_over_budget,
            cost=self.cost_model.stats(),
        )

    def check_integrity(self) -> None:
        self._queues.check_integrity()
        self.cost_model.check_integrity()
        assert all(0 <= s <= self._step for s in self._waiting_since), "bad bucket wait marks"

    def _seqs_share(self, draft: _StepDraft, later: int) -> int:
        """Request slots a bucket may take in the shares pass: it leaves one for each later
        non-empty bucket, yet gets one itself while any is free (shorter buckets first)."""
        free = self.config.max_num_seqs - draft.num_seqs
        return max(free - later, min(free, 1))

    def _tokens_left(self, draft: _StepDraft) -> int:
        return self.config.max_num_batched_tokens - draft.num_tokens

    def _serve_starving(self, draft: _StepDraft, nonempty: list[int]) -> bool:
        """Give one aligned chunk to each bucket unserved for `max_wait_steps` steps."""
        starving = [
            i for i in nonempty if self._step - self._waiting_since[i] > self.config.max_wait_steps
        ]
        for i in starving:
            self._force_unit(draft, i)
        return bool(starving)

    def _force_unit(self, draft: _StepDraft, bucket: int) -> None:
        """Plan the smallest aligned chunk of the bucket's head, regardless of budget."""
        head = self._queues.head(bucket)
        assert head is not None, "forcing an empty bucket"
        align = self.config.chunk_align_tokens
        ctx = head.num_computed_tokens
        n = min(head.num_remaining_tokens, align - ctx % align)
        draft.set(head, n, self.cost_model.chunk_cost_s(n, ctx))

    def _fill(
        self, draft: _StepDraft, bucket: int, *, time_s: float, num_tokens: int, num_seqs: int
    ) -> None:
        """Extend the chunks of the bucket's requests, oldest first, within these allowances
        (marginal seconds, new tokens, new requests). Strict FIFO: stops at the first request
        that cannot be planned in full."""
        model = self.cost_model
        for entry in self._queues.bucket(bucket):
            n0 = draft.tokens_of(entry)
            if n0 == entry.num_remaining_tokens:
                continue
            if n0 == 0 and num_seqs < 1:
                return
            ctx = entry.num_computed_tokens
            cost0 = model.chunk_cost_s(n0, ctx)
            fit = model.max_tokens_within(max(cost0 + time_s, 0.0), ctx, include_overhead=False)
            n = self._aligned(entry, min(fit, n0 + max(num_tokens, 0)))
            if n <= n0:
                return
            extra_s = model.chunk_cost_s(n, ctx) - cost0
            draft.set(entry, n, extra_s)
            time_s -= extra_s
            num_tokens -= n - n0
            num_seqs -= n0 == 0
            if n < entry.num_remaining_tokens:
                return

    def _aligned(self, entry: PrefillEntry, num_new_tokens: int) -> int:
        """Clamp to the remaining tokens; a chunk that does not finish ends on an aligned
        position (possibly giving 0 tokens)."""
        if num_new_tokens >= entry.num_remaining_tokens:
            return entry.num_remaining_tokens
        align = self.config.chunk_align_tokens
        end = (entry.num_computed_tokens + num_new_tokens) // align * align
        return max(end - entry.num_computed_tokens, 0)

    def _commit(self, draft: _StepDraft, forced: bool) -> PrefillPlan:
        """Advance the planned requests, retire finished prefills, mark served buckets."""
        planned = sorted(draft.entries.values(), key=lambda en: en[0].bucket)
        chunks: list[PlannedChunk] = []
        for entry, n in planned:
            assert 0 < n <= entry.num_remaining_tokens, "chunk outside the request"
            is_last = n == entry.num_remaining_tokens
            chunks.append(
                PlannedChunk(entry.request_id, entry.num_computed_tokens, n, entry.bucket, is_last)
            )
            entry.num_computed_tokens += n
            if entry.first_planned_step < 0:
                entry.first_planned_step = self._step
            self._waiting_since[entry.bucket] = self._step
            if is_last:
                self._queues.pop(entry.request_id)
        shapes = [c.shape for c in chunks]
        return PrefillPlan(
            step=self._step,
            chunks=tuple(chunks),
            predicted_s=self.cost_model.predict(shapes),
            budget_s=self.budget_s,
            forced=forced,
        )
