"""Lanes: one worker's view of a scheduler (the colocated `Scheduler` is its own single lane)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from deepinfer.outputs import RunnerOutput, TokenDelta
from deepinfer.scheduler.output import ScheduleOutput, StepKind

if TYPE_CHECKING:
    from deepinfer.scheduler.disagg import DisaggScheduler


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
