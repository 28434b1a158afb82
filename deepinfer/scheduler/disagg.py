"""`DisaggScheduler`: prefill and decode as two lanes, each run by its own worker.

A request moves WAITING -> prefilling -> decoding -> finished:

- Admission (on the prefill lane, `WaitingQueue`, shared with the colocated scheduler) takes the
  prefix-cache hit and allocates blocks for the whole uncached prompt at once, then queues the
  request in the `PrefillPlanner` (length buckets, a time budget per step, chunked prefill).
  Admission keeps one free block per decoding request in reserve, and a prefilling request never
  needs another block: prefill never waits on decode. A request whose shared prefix another
  request is computing waits for it instead of computing it again.
- The prefill lane's steps are the planner's plans. The chunk that completes a prompt samples
  the first token and hands the request to the decode lane. With one KV pool (both workers on
  one device) that is block ownership: the blocks it filled are now the decoder's, nothing is
  copied. With separate pools (separate device groups, `decode_kv` given) the request waits for
  blocks in the decode pool, then for a `KVHandoff` copy the engine runs (`drain_handoffs`,
  `complete_handoff`); its prefill blocks are freed after the copy and stay in the prefix cache.
- The decode lane batches every decoding request, one token each, up to `max_num_seqs`. When
  a block is missing the newest decoder is preempted by recompute (back to the waiting queue).

Both lanes may have one step in flight at the same time. They never share a request. Blocks one
lane's step writes belong to its requests; blocks handed out are free ones, which no step reads;
a block becomes visible to prefix hits only after the step that filled it is applied. An abort
of a request inside an in-flight step is deferred to that step's `update`, so its blocks are
never freed under a running forward pass.
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter

from deepinfer.cache.free_queue import require
from deepinfer.cache.manager import KVCacheManager
from deepinfer.config import SchedulerConfig
from deepinfer.outputs import RunnerOutput, TokenDelta
from deepinfer.request import FinishReason, Request, RequestStatus
from deepinfer.scheduler.admission import WaitingQueue
from deepinfer.scheduler.cost_model import StepCostModel
from deepinfer.scheduler.decode_lane import apply_decodes, apply_sampling, plan_decodes
from deepinfer.scheduler.drafting import Drafter
from deepinfer.scheduler.output import KVHandoff, ScheduledChunk, ScheduleOutput, StepKind
from deepinfer.scheduler.prefill_planner import PrefillPlanner
from deepinfer.scheduler.prefill_types import PlannerStats, PrefillPlan, PrefillPlannerConfig
from deepinfer.scheduler.protocol import RequestTable, StepLane
from deepinfer.scheduler.token_delta import token_delta

_NEW_TOKENS = attrgetter("num_new_tokens")


class DisaggScheduler(RequestTable):
    """Prefill and decode as two lanes (`EngineScheduler`)."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        planner_config: PrefillPlannerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        cost_model: StepCostModel | None = None,
        decode_kv: KVCacheManager | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.kv = kv
        """The prefill pool: admission, prefix hits, and (one pool) decoding too."""
        self.decode_kv = decode_kv if decode_kv is not None else kv
        """The decode pool: `kv` itself, or a separate pool on the decode device group."""
        self.max_model_len = max_model_len
        self.max_request_tokens = min(
            max_model_len, kv.capacity_tokens, self.decode_kv.capacity_tokens
        )
        self.planner = PrefillPlanner(planner_config, cost_model or StepCostModel())
        self.queue = WaitingQueue(kv, self.max_request_tokens, scheduler_config.max_waiting)
        self.prefilling: dict[str, Request] = {}
        self.decoding: list[Request] = []
        self.handoff_waiting: deque[Request] = deque()
        """Prefilled requests waiting for blocks in the decode pool (separate pools only)."""
        self.handing_off: dict[str, Request] = {}
        """Requests whose KV copy is ordered and not yet complete."""
        self._handoffs: list[KVHandoff] = []
        self._in_flight: dict[StepKind, tuple[ScheduleOutput, PrefillPlan | None]] = {}
        self._deferred_aborts: set[str] = set()
        self._steps = {StepKind.PREFILL: 0, StepKind.DECODE: 0}
        self.num_preemptions = 0
        self.drafter = drafter
        """Speculative decoding's drafts for decode steps; None: off."""

    # -- queries --
    @property
    def split_pools(self) -> bool:
        """Decode has its own pool (separate device groups): KV is copied on handoff."""
        return self.decode_kv is not self.kv

    @property
    def num_running(self) -> int:
        handoffs = len(self.handoff_waiting) + len(self.handing_off)
        return len(self.prefilling) + handoffs + len(self.decoding)

    @property
    def has_work(self) -> bool:
        handoffs = self.handoff_waiting or self.handing_off
        return bool(self.waiting or self.prefilling or handoffs or self.decoding)

    def lanes(self) -> tuple[StepLane, ...]:
        return (PrefillLane(self), DecodeLane(self))

    def planner_stats(self) -> PlannerStats | None:
        return self.planner.stats()

    # -- requests --
    def abort(self, request_id: str) -> bool:
        """Finish a request with ABORT and free its blocks: now, or at the end of the in-flight
        step that holds it. False if unknown (already finished or never added)."""
        request = self._requests.get(request_id)
        if request is None or request_id in self._deferred_aborts:
            return False
        in_steps = any(request_id in so_ids(so) for so, _ in self._in_flight.values())
        if in_steps or request_id in self.handing_off:
            self._deferred_aborts.add(request_id)
            return True
        self._remove(request)
        self._finish(request, FinishReason.ABORT)
        return True

    # -- the prefill lane --
    def schedule_prefill(self) -> ScheduleOutput:
        assert StepKind.PREFILL not in self._in_flight, "prefill step already in flight"
        self._admit()
        self._steps[StepKind.PREFILL] += 1
        plan = self.planner.plan() if self.planner.has_work else None
        chunks = () if plan is None else tuple(self._planned_chunks(plan))
        so = ScheduleOutput(
            step=self._steps[StepKind.PREFILL],
            chunks=chunks,
            kind=StepKind.PREFILL,
            predicted_s=None if plan is None else plan.predicted_s,
        )
        self._in_flight[StepKind.PREFILL] = (so, plan)
        return so

    def _admit(self) -> None:
        """Admit waiting requests in arrival order while their whole prompt fits, keeping a
        block per decoder in reserve (the head of the queue blocks those behind it)."""
        room = self.max_num_seqs - self.num_running
        reserve = 0 if self.split_pools else len(self.decoding)
        for request, _ in self.queue.admit(room, reserve_blocks=reserve):
            self.prefilling[request.request_id] = request
            self.planner.add(request)

    def _planned_chunks(self, plan: PrefillPlan) -> list[ScheduledChunk]:
        chunks = []
        for pc in plan.chunks:
            request = self.prefilling[pc.request_id]
            assert pc.start_position == request.num_computed_tokens, "planner out of step"
            tables = self.kv.chunk_tables(request, pc.start_position + pc.num_new_tokens)
            chunks.append(
                ScheduledChunk(
                    request=request,
                    start_position=pc.start_position,
                    num_new_tokens=pc.num_new_tokens,
                    block_ids=tables.block_ids,
                    sample=pc.is_last,
                    window_block_ids=tables.window_block_ids,
                    cached_until=tables.cached_until,
                )
            )
        return chunks

    def update_prefill(self, so: ScheduleOutput, out: RunnerOutput) -> list[TokenDelta]:
        plan = self._pop_in_flight(StepKind.PREFILL, so)
        if plan is not None:
            self.planner.observe(plan, out.elapsed_s)
        deltas: list[TokenDelta] = []
        for chunk in so.chunks:
            request = chunk.request
            if request.request_id in self._deferred_aborts:
                continue
            self.queue.computed(chunk.num_new_tokens)
            if not chunk.sample:
                request.num_computed_tokens = chunk.end_position
                self.kv.cache_blocks(request)
                continue
            del self.prefilling[request.request_id]
            deltas.append(self._sampled(chunk, out, self.kv))
            if not request.is_finished:
                self._to_decode(request)
        self._apply_deferred_aborts(so)
        return deltas

    def _to_decode(self, request: Request) -> None:
        if self.split_pools:
            self.handoff_waiting.append(request)
        else:
            self.decoding.append(request)

    # -- KV handoffs between separate pools --
    def drain_handoffs(self) -> list[KVHandoff]:
        """Order the copies whose decode blocks can be allocated now (arrival order, keeping a
        block per decoder in reserve) and return every copy ordered since the last call."""
        while self.handoff_waiting:
            request = self.handoff_waiting[0]
            reserve = len(self.decoding)
            if not self.decode_kv.can_allocate(request, 0, reserve_blocks=reserve):
                break
            allocated = self.decode_kv.allocate_slots(request, 0)
            assert allocated, "can_allocate promised room"
            self.handoff_waiting.popleft()
            rid = request.request_id
            dst = self.decode_kv.block_ids(rid)
            self.handing_off[rid] = request
            self._handoffs.append(KVHandoff(rid, self.kv.block_ids(rid)[: len(dst)], dst))
        handoffs, self._handoffs = self._handoffs, []
        return handoffs

    def complete_handoff(self, request_id: str) -> bool:
        """The copy for `request_id` is done: free its prefill blocks (their content stays in
        the prefix cache) and start decoding it (True), or finish it if it was aborted
        meanwhile (False)."""
        request = self.handing_off.pop(request_id)
        self.kv.free(request)
        if request_id in self._deferred_aborts:
            self._deferred_aborts.discard(request_id)
            self._finish(request, FinishReason.ABORT)
            return False
        self.decoding.append(request)
        return True

    # -- the decode lane --
    def schedule_decode(self) -> ScheduleOutput:
        assert StepKind.DECODE not in self._in_flight, "decode step already in flight"
        self._steps[StepKind.DECODE] += 1
        chunks, preempted = plan_decodes(
            self.decoding, self.decode_kv, self.drafter, self.max_request_tokens, self._preempt
        )
        so = ScheduleOutput(
            step=self._steps[StepKind.DECODE],
            chunks=tuple(chunks),
            preempted_ids=tuple(preempted),
            kind=StepKind.DECODE,
            plain_decodes=self._plain(chunks),
        )
        self._in_flight[StepKind.DECODE] = (so, None)
        return so

    def _plain(self, chunks: list[ScheduledChunk]) -> bool:
        """`ScheduleOutput.plain_decodes`: one pool, and no chunk with drafts (one C loop over
        the chunks, not a call each)."""
        return self.decode_kv.window is None and max(map(_NEW_TOKENS, chunks), default=1) == 1

    def update_decode(self, so: ScheduleOutput, out: RunnerOutput) -> list[TokenDelta]:
        self._pop_in_flight(StepKind.DECODE, so)
        if self.drafter is not None:
            self.drafter.observe_step(so, out)
        aborts, kv = self._deferred_aborts, self.decode_kv
        if so.plain_decodes and not aborts:
            deltas, finished = apply_decodes(so.chunks, out, kv, self.max_model_len)
            for request, reason in finished:
                self._finish(request, reason)
        else:
            deltas = [
                self._sampled(chunk, out, kv)
                for chunk in so.chunks
                if not aborts or chunk.request.request_id not in aborts
            ]
        if any(r.is_finished for r in self.decoding):
            self.decoding = [r for r in self.decoding if not r.is_finished]
        self._apply_deferred_aborts(so)
        return deltas

    # -- both lanes --
    def fail_step(self, kind: StepKind, so: ScheduleOutput) -> list[str]:
        """Finish the requests of lane `kind`'s failed step with ERROR (see `StepLane.fail`);
        those the caller aborted (deferred aborts) finish aborted and are not returned."""
        entry = self._in_flight.get(kind)
        if entry is not None and entry[0] is so:  # else an update popped it, then raised
            del self._in_flight[kind]
        failed: list[str] = []
        for chunk in so.chunks:
            rid, request = chunk.request_id, chunk.request
            aborted = rid in self._deferred_aborts
            self._deferred_aborts.discard(rid)
            if self._requests.get(rid) is request:
                assert rid not in self.handing_off, "a failed step's request is being copied"
                self._remove(request)
                self._finish(request, FinishReason.ABORT if aborted else FinishReason.ERROR)
            if not aborted and request.finish_reason is not FinishReason.ABORT:
                request.finish_reason = FinishReason.ERROR  # its final delta, if any, was lost
                failed.append(rid)
        if any(r.is_finished for r in self.decoding):
            self.decoding = [r for r in self.decoding if not r.is_finished]
        return failed

    # -- shared --
    def _pop_in_flight(self, kind: StepKind, so: ScheduleOutput) -> PrefillPlan | None:
        in_flight, plan = self._in_flight.pop(kind)
        assert in_flight is so, f"update() must follow the {kind.value} schedule() that made so"
        return plan

    def _sampled(self, chunk: ScheduledChunk, out: RunnerOutput, kv: KVCacheManager) -> TokenDelta:
        """Apply a sampling chunk's result (`apply_sampling`), finish its request if done; the
        request's delta."""
        request = chunk.request
        taken, reason = apply_sampling(chunk, out, kv, self.drafter, self.max_model_len)
        if reason is not None:
            self._finish(request, reason)
        prompt = out.prompt_logprobs.get(request.request_id) if out.prompt_logprobs else None
        return token_delta(request, taken, reason, prompt)

    def _apply_deferred_aborts(self, so: ScheduleOutput) -> None:
        if not self._deferred_aborts:
            return
        for rid in so_ids(so) & self._deferred_aborts:
            self._deferred_aborts.discard(rid)
            request = self._requests.get(rid)
            if request is not None:
                self._remove(request)
                self._finish(request, FinishReason.ABORT)

    def _remove(self, request: Request) -> None:
        """Take a live request out of whichever queue holds it."""
        rid = request.request_id
        if self.prefilling.pop(rid, None) is not None:
            self.planner.remove(rid)
        elif any(r is request for r in self.handoff_waiting):
            self.handoff_waiting = deque(r for r in self.handoff_waiting if r is not request)
        elif request.status is RequestStatus.RUNNING:
            self.decoding = [r for r in self.decoding if r is not request]
        else:
            self.queue.remove(request)

    def _preempt(self, request: Request) -> None:
        self.queue.preempt(self.decode_kv, request)
        self.num_preemptions += 1

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if self.drafter is not None:
            self.drafter.forget(request.request_id)
        if self.split_pools:
            self.decode_kv.free(request)
        self.queue.finish(self.kv, request, reason)

    def check_integrity(self) -> None:
        """Queues partition the live requests; prefilling ones hold blocks for their whole
        prompt and match the planner; decoders have computed all but their last token; requests
        between the pools hold the blocks their copy needs."""
        self.kv.check_integrity()
        if self.split_pools:
            self.decode_kv.check_integrity()
        self.planner.check_integrity()
        decoding = [r.request_id for r in self.decoding]
        ids = decoding + list(self.prefilling) + [r.request_id for r in self.waiting]
        ids += [r.request_id for r in self.handoff_waiting] + list(self.handing_off)
        require(len(ids) == len(set(ids)), "a request is queued twice")
        require(set(ids) == set(self.queue.requests), "queues and the request table disagree")
        require(self.num_running <= self.max_num_seqs, "more running requests than max_num_seqs")
        planned = self.planner.queued_ids() | self.in_flight_prefill_ids()
        require(set(self.prefilling) == planned, "prefilling requests and the planner disagree")
        bs = self.kv.block_size
        for r in self.prefilling.values():
            require(r.status is RequestStatus.RUNNING, f"{r.request_id} prefills as {r.status}")
            short = self.kv.num_blocks_of(r.request_id) < -(-r.num_tokens // bs)
            require(not short, f"{r.request_id} holds too few blocks for its prompt")
            self.kv.check_window(r)
        for r in self.decoding:
            require(r.status is RequestStatus.RUNNING, f"{r.request_id} decodes as {r.status}")
            require(r.num_computed_tokens == r.num_tokens - 1, f"{r.request_id} out of step")
            stale = self.split_pools and self.kv.num_blocks_of(r.request_id) > 0
            require(not stale, f"{r.request_id} decodes holding prefill blocks")
            self.decode_kv.check_window(r)
        self._check_handoffs()
        self.queue.check_integrity()
        for r in self.waiting:
            require(self.decode_kv.num_blocks_of(r.request_id) == 0, "waiting with decode blocks")

    def _check_handoffs(self) -> None:
        """Requests between the pools hold their prompt's prefill blocks; those with a copy ordered
        also hold exactly as many decode blocks."""
        bs = self.kv.block_size
        for r in [*self.handoff_waiting, *self.handing_off.values()]:
            require(r.status is RequestStatus.RUNNING, f"{r.request_id} hands off as {r.status}")
            require(r.num_computed_tokens == r.num_tokens - 1, f"{r.request_id} out of step")
            num_blocks = -(-r.num_computed_tokens // bs)
            require(self.kv.num_blocks_of(r.request_id) >= num_blocks, "handoff source freed")
            ordered = r.request_id in self.handing_off
            expected = num_blocks if ordered else 0
            require(self.decode_kv.num_blocks_of(r.request_id) == expected, "handoff blocks")
        require(self.ordered_handoff_ids <= set(self.handing_off), "a copy ordered for no handoff")

    @property
    def ordered_handoff_ids(self) -> set[str]:
        """Requests whose KV copy is ordered and not yet drained."""
        return {h.request_id for h in self._handoffs}

    def in_flight_prefill_ids(self) -> set[str]:
        """Requests whose last prefill chunk is planned but not yet applied."""
        entry = self._in_flight.get(StepKind.PREFILL)
        return {c.request_id for c in entry[0].chunks if c.sample} if entry else set()


def so_ids(so: ScheduleOutput) -> set[str]:
    return {c.request_id for c in so.chunks}


class PrefillLane:
    """The prefill worker's lane: admission and the planner's chunks."""

    kind = StepKind.PREFILL

    def __init__(self, scheduler: DisaggScheduler) -> None:
        self._s = scheduler

    @property
    def has_work(self) -> bool:
        return bool(self._s.waiting or self._s.planner.has_work)

    def schedule(self) -> ScheduleOutput:
        return self._s.schedule_prefill()

    def update(self, so: ScheduleOutput, out: RunnerOutput) -> list[TokenDelta]:
        return self._s.update_prefill(so, out)

    def fail(self, so: ScheduleOutput) -> list[str]:
        return self._s.fail_step(self.kind, so)


class DecodeLane:
    """The decode worker's lane: one token for every decoding request."""

    kind = StepKind.DECODE

    def __init__(self, scheduler: DisaggScheduler) -> None:
        self._s = scheduler

    @property
    def has_work(self) -> bool:
        return bool(self._s.decoding)

    def schedule(self) -> ScheduleOutput:
        return self._s.schedule_decode()

    def update(self, so: ScheduleOutput, out: RunnerOutput) -> list[TokenDelta]:
        return self._s.update_decode(so, out)

    def fail(self, so: ScheduleOutput) -> list[str]:
        return self._s.fail_step(self.kind, so)
