"""What the engine sees of a scheduler: `EngineScheduler`, which both schedulers implement (the
colocated `Scheduler`, one lane; the `DisaggScheduler`, a prefill and a decode lane), and
`StepLane`, one worker's view of it. `RequestTable` is their shared part: the waiting queue and
the request table, and the queries over them.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from deepinfer.outputs import RunnerOutput, TokenDelta
from deepinfer.request import Request
from deepinfer.scheduler.admission import PrefillCounts, WaitingQueue
from deepinfer.scheduler.drafting import Drafter
from deepinfer.scheduler.output import KVHandoff, ScheduleOutput, StepKind
from deepinfer.scheduler.prefill_types import PlannerStats
from deepinfer.scheduler.speculative import SpeculativeCounts


class StepLane(Protocol):
    """One worker's view of the scheduler: it plans and applies its own steps, one at a time
    (`update` of a step before the next `schedule`). Lanes of one scheduler may have steps in
    flight at the same time: they never share a request, and a block a step writes is never
    read or handed out by another lane's step before it is applied."""

    @property
    def kind(self) -> StepKind: ...

    @property
    def has_work(self) -> bool: ...

    def schedule(self) -> ScheduleOutput: ...

    def update(self, so: ScheduleOutput, out: RunnerOutput) -> list[TokenDelta]: ...

    def fail(self, so: ScheduleOutput) -> list[str]:
        """The step `so` failed (its forward pass, or its `update` part way): finish every live
        request of the step and free its blocks; nothing the step computed enters the prefix
        cache. Instead of `update`, or after an `update` that raised. Afterwards the scheduler
        is consistent (`check_integrity` passes) and the lane schedules its next step. Returns
        the ids of the step's requests whose output must end with an error: all but those the
        caller aborted meanwhile (including any an update finished before it raised)."""
        ...


class EngineScheduler(Protocol):
    """A scheduler as the engine drives it: requests in and out, its lanes, KV handoffs between
    separate pools (none where there is one pool), counters and the integrity check."""

    drafter: Drafter | None
    """Speculative decoding's drafts; None: off."""

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def has_work(self) -> bool: ...

    def lanes(self) -> tuple[StepLane, ...]: ...

    def get_request(self, request_id: str) -> Request | None: ...

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises `InvalidRequestError` (empty prompt, duplicate id),
        `ContextLengthError` (cannot fit), `OverloadedError` (queue full)."""
        ...

    def abort(self, request_id: str) -> bool:
        """Finish a request with ABORT and free its blocks (now, or once the step or copy that
        holds it ends). False if unknown (already finished or never added)."""
        ...

    def drain_handoffs(self) -> list[KVHandoff]:
        """KV copies to run now between the pools (empty with one pool)."""
        ...

    def complete_handoff(self, request_id: str) -> bool:
        """After a drained handoff's copy: the request decodes from the decode pool. False when
        it was aborted meanwhile (the caller releases it)."""
        ...

    def planner_stats(self) -> PlannerStats | None:
        """The prefill planner's queues and cost model (None without a planner)."""
        ...

    def prefill_counts(self) -> PrefillCounts: ...

    def speculative_counts(self) -> SpeculativeCounts: ...

    def check_integrity(self) -> None: ...


class RequestTable:
    """The part both schedulers share: the waiting queue (and with it the table of live
    requests) and the queries over it."""

    queue: WaitingQueue
    drafter: Drafter | None

    @property
    def waiting(self) -> deque[Request]:
        return self.queue.queue

    @property
    def _requests(self) -> dict[str, Request]:
        return self.queue.requests

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def add_request(self, request: Request) -> None:
        """Queue a new request (raises as `EngineScheduler.add_request` says)."""
        self.queue.add(request)

    def prefill_counts(self) -> PrefillCounts:
        return self.queue.counts()

    def speculative_counts(self) -> SpeculativeCounts:
        return self.drafter.counts() if self.drafter is not None else SpeculativeCounts()
