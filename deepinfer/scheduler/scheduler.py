"""`Scheduler`: pure, synchronous continuous batching over the KV cache manager.

One rule drives everything: each request's `num_computed_tokens` catches up with its
`num_tokens`. A step schedules, within `max_num_batched_tokens`:

1. running requests, oldest first (decodes, and the next chunk of prefills already under way).
   When blocks run out, the newest running request is preempted by recompute: its blocks are
   freed (their cached content stays hittable), `num_computed_tokens` goes back to 0 and it
   rejoins the front of the waiting queue;
2. then, if nobody was preempted, waiting requests in FCFS order up to `max_num_seqs` running,
   each starting after its prefix-cache hit, chunked to the budget left (chunked prefill).
   The queue head blocks those behind it (no overtaking: FCFS is the fairness rule), except a
   request waiting for a shared prefix another request is computing (`WaitingQueue`).

Steps are strictly sequential: `update(so, out)` applies the latest `schedule()` before the next.

A lone request always fits: `add_request` refuses requests whose prompt plus `max_tokens`
exceed the smaller of `max_model_len` and the whole pool, with `ContextLengthError`. So the
oldest running request can always progress, and every request eventually finishes.
"""

from __future__ import annotations

from deepinfer.cache.free_queue import require
from deepinfer.cache.manager import KVCacheManager
from deepinfer.config import SchedulerConfig
from deepinfer.outputs import RunnerOutput, TokenDelta
from deepinfer.request import FinishReason, Request, RequestStatus
from deepinfer.scheduler.admission import WaitingQueue
from deepinfer.scheduler.decode_lane import apply_sampling, decode_chunk
from deepinfer.scheduler.draft_gate import Draft
from deepinfer.scheduler.drafting import Drafter
from deepinfer.scheduler.output import KVHandoff, ScheduledChunk, ScheduleOutput, StepKind
from deepinfer.scheduler.prefill_types import PlannerStats
from deepinfer.scheduler.protocol import RequestTable, StepLane
from deepinfer.scheduler.token_delta import token_delta


class Scheduler(RequestTable):
    """The colocated scheduler: one lane (itself) runs every step (`EngineScheduler`)."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        drafter: Drafter | None = None,
    ) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_request_tokens = min(max_model_len, kv.capacity_tokens)
        """Prompt plus max_tokens must fit here: the context and the whole KV pool."""
        self.queue = WaitingQueue(kv, self.max_request_tokens, scheduler_config.max_waiting)
        self.running: list[Request] = []
        self._step = 0
        self.num_preemptions = 0
        self.drafter = drafter
        """Speculative decoding's drafts for the decodes of a step; None: off."""

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def kind(self) -> StepKind:
        return StepKind.MIXED

    def lanes(self) -> tuple[StepLane, ...]:
        """Colocated: one worker runs every step."""
        return (self,)

    def drain_handoffs(self) -> list[KVHandoff]:
        return []  # one pool: nothing is ever copied

    def complete_handoff(self, request_id: str) -> bool:
        raise ValueError(f"{request_id}: a colocated scheduler orders no handoffs")

    def planner_stats(self) -> PlannerStats | None:
        return None

    def abort(self, request_id: str) -> bool:
        """Finish a waiting or running request with ABORT and free its blocks. False if unknown
        (already finished or never added)."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running = [r for r in self.running if r is not request]
        else:
            self.queue.remove(request)
        self._finish(request, FinishReason.ABORT)
        return True

    def schedule(self) -> ScheduleOutput:
        """Plan one step. Mutates request state (status, computed prefix) and block tables."""
        self._step += 1
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        drafted = self._plan_drafts()
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            draft = drafted.get(request.request_id)
            after = len(self.running) - i - 1
            if draft is not None and self._take_draft_slots(request, draft, budget, after):
                chunks.append(decode_chunk(request, self.kv, draft))
                budget -= 1 + draft.size
                i += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                chunks.append(self._chunk(request, num_new))
                budget -= num_new
                i += 1
        if not preempted and budget > 0:
            self._admit(budget, chunks)
        return ScheduleOutput(step=self._step, chunks=tuple(chunks), preempted_ids=tuple(preempted))

    def _plan_drafts(self) -> dict[str, Draft]:
        """The drafts of the running decoders (their last token alone left to compute)."""
        if self.drafter is None:
            return {}
        decoders = [
            r
            for r in self.running
            if r.num_computed_tokens == r.num_tokens - 1
            and r.num_computed_tokens >= r.num_prompt_tokens
        ]
        return self.drafter.plan(decoders, self.max_request_tokens) if decoders else {}

    def _take_draft_slots(
        self, request: Request, draft: Draft, budget: int, running_after: int
    ) -> bool:
        """Slots for a decoder's token and drafts within the step's budget, keeping a block for
        each running request after it; False: none allocated."""
        assert self.drafter is not None
        return 1 + draft.size <= budget and self.drafter.take_slots(
            self.kv, request, draft, running_after
        )

    def _admit(self, budget: int, chunks: list[ScheduledChunk]) -> None:
        room = self.max_num_seqs - len(self.running)
        for request, num_new in self.queue.admit(room, token_budget=budget):
            self.running.append(request)
            chunks.append(self._chunk(request, num_new))

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        tables = self.kv.chunk_tables(request, start + num_new)
        return ScheduledChunk(
            request=request,
            start_position=start,
            num_new_tokens=num_new,
            block_ids=tables.block_ids,
            sample=start + num_new == request.num_tokens,
            window_block_ids=tables.window_block_ids,
            cached_until=tables.cached_until,
        )

    def _preempt(self, request: Request) -> None:
        self.queue.preempt(self.kv, request)
        self.num_preemptions += 1

    def update(self, so: ScheduleOutput, out: RunnerOutput) -> list[TokenDelta]:
        """Apply a step's results: advance computed prefixes, register newly computed blocks in
        the prefix cache, append sampled tokens, finish requests. Returns one delta per request
        that got a token (requests aborted while the step ran are skipped)."""
        assert so.step == self._step, "update() must follow the schedule() that made `so`"
        deltas: list[TokenDelta] = []
        finished = False
        if self.drafter is not None:
            self.drafter.observe_step(so, out)
        for chunk in so.chunks:
            request = chunk.request
            if self._requests.get(request.request_id) is not request:
                continue
            assert request.status is RequestStatus.RUNNING
            assert chunk.start_position == request.num_computed_tokens, "chunk out of order"
            if not chunk.is_decode:
                self.queue.computed(chunk.num_new_tokens)
            if not chunk.sample:
                request.num_computed_tokens = chunk.end_position
                self.kv.cache_blocks(request)
                continue
            taken, reason = apply_sampling(chunk, out, self.kv, self.drafter, self.max_model_len)
            if reason is not None:
                self._finish(request, reason)
                finished = True
            prompt = out.prompt_logprobs.get(request.request_id) if out.prompt_logprobs else None
            deltas.append(token_delta(request, taken, reason, prompt))
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
        return deltas

    def fail(self, so: ScheduleOutput) -> list[str]:
        """Finish the requests of a failed step with ERROR (see `StepLane.fail`); those the
        caller aborted stay aborted and are not returned."""
        failed: list[str] = []
        for chunk in so.chunks:
            request = chunk.request
            if self._requests.get(request.request_id) is request:
                assert request.status is RequestStatus.RUNNING, "a step's requests run"
                self._finish(request, FinishReason.ERROR)
            if request.finish_reason is not FinishReason.ABORT:  # its final delta was lost
                request.finish_reason = FinishReason.ERROR
                failed.append(request.request_id)
        self.running = [r for r in self.running if not r.is_finished]
        return failed

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.queue.finish(self.kv, request, reason)
        if self.drafter is not None:
            self.drafter.forget(request.request_id)

    def check_integrity(self) -> None:
        """Queues partition the live requests, statuses match queues, budgets hold, and the
        cache manager's own invariants hold."""
        self.kv.check_integrity()
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        require(len(ids) == len(set(ids)), "a request is queued twice")
        require(set(ids) == set(self._requests), "queues and the request table disagree")
        require(len(self.running) <= self.max_num_seqs, "more running requests than max_num_seqs")
        for r in self.running:
            require(r.status is RequestStatus.RUNNING, f"{r.request_id} running as {r.status}")
            require(r.num_computed_tokens < r.num_tokens, f"{r.request_id} has nothing to compute")
            self.kv.check_window(r)
            blocks_needed = -(-r.num_computed_tokens // self.kv.block_size)
            require(self.kv.num_blocks_of(r.request_id) >= blocks_needed, "computed KV lost")
        self.queue.check_integrity()
