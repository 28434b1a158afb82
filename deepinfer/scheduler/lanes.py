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
