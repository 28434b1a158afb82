"""Several decoding modes measured in one run, taking turns every second: `alternating`.

A CPU shared with other machines drifts by 5-10% over tens of seconds, more than the effects a
speculative benchmark measures, so two modes measured one after the other, each for ten seconds,
differ by noise as often as by method. Here the modes share one closed loop of streams
(`engine_load.closed_loop`) and take turns by the second: each decode step is planned in the
mode of the second it starts in, and its tokens and its time (up to the next step's planning)
count for that mode. Drift then falls on every mode alike, and the requests in flight are the
same for all of them.

The modes: `plain` (no drafts, nothing asked of the drafter), `gate` (the confidence gate on),
`all` (every draft verified; the worker drafter's confidence cut off too).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_load import closed_loop

from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.prompts import Prompt
from deepinfer.outputs import RunnerOutput
from deepinfer.request import Request, SamplingParams
from deepinfer.runner.worker_draft import DRAFT_CONFIDENCE_MIN
from deepinfer.scheduler.draft_gate import Draft
from deepinfer.scheduler.drafting import Drafter
from deepinfer.scheduler.output import ScheduleOutput
from deepinfer.scheduler.speculative import SpeculativeCounts

SETTLE_S = 2.0
"""Steps planned this long after the streams start are not counted: the first prompts' prefill
and the batch filling up."""


def balanced(order: tuple[str, ...]) -> tuple[str, ...]:
    """Turns in which every mode follows every other as often (a, b, c -> a b c a c b): a
    mode's step leaves work behind for the next (the requests it finished are prefilled in the
    next mode's time), so a fixed cycle would have one mode always pay for the same other one
    (measured: with plain always after all, the gate drafting nothing beat plain by 2-3%)."""
    if len(order) < 3:
        return order
    first, *rest = order
    return (*order, first, *reversed(rest))


@dataclass
class ModeTally:
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    verified: int = 0
    """Request-steps that verified drafts."""


@dataclass
class Alternation:
    """Stands in for the scheduler's drafter during one measurement (see the module docstring).
    The drafter's own methods run only in the modes that draft; a request's end is passed on in
    every mode (its state is dropped)."""

    drafter: Drafter
    worker: Any
    """The decode runner's worker drafter (a model proposer's), or None."""
    order: tuple[str, ...]
    block_s: float = 1.0
    tallies: dict[str, ModeTally] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tallies = {m: ModeTally() for m in self.order}
        self.turns = balanced(self.order)
        self._start = time.perf_counter()
        self._stop = float("inf")
        self._step: tuple[str, float] | None = None
        """(mode, planned at) of the step in flight."""

    def count_until(self, seconds: float) -> None:
        """Steps planned `seconds` after the start or later are not counted."""
        self._stop = self._start + seconds

    def _mode(self, now: float) -> str:
        return self.turns[int((now - self._start) / self.block_s) % len(self.turns)]

    def plan(self, decoding: Sequence[Request], max_tokens: int) -> dict[str, Draft]:
        now = time.perf_counter()
        if self._step is not None:
            mode, planned = self._step
            if self._start + SETTLE_S <= planned < self._stop:
                self.tallies[mode].seconds += now - planned
        mode = self._mode(now)
        self._step = (mode, now)
        if mode == "plain":
            return {}
        self.drafter.gate.enabled = mode == "gate"
        if self.worker is not None:
            self.worker.min_confidence = DRAFT_CONFIDENCE_MIN if mode == "gate" else 0.0
        return self.drafter.plan(decoding, max_tokens)

    def _counted(self) -> ModeTally | None:
        if self._step is None:
            return None
        mode, planned = self._step
        return self.tallies[mode] if self._start + SETTLE_S <= planned < self._stop else None

    def observe_step(self, so: ScheduleOutput, out: RunnerOutput) -> None:
        tally = self._counted()
        if tally is not None:
            tally.tokens += sum(
                1 + len(out.accepted.get(c.request_id, ()))
                for c in so.chunks
                if c.request_id in out.sampled
            )
        if self._step is not None and self._step[0] != "plain":
            self.drafter.observe_step(so, out)

    def observe_request(self, request: Request, num_drafts: int, out: RunnerOutput) -> None:
        tally = self._counted()
        if tally is not None and num_drafts:
            tally.drafted += num_drafts
            tally.accepted += len(out.accepted.get(request.request_id, ()))
            tally.verified += 1
        self.drafter.observe_request(request, num_drafts, out)

    def take_slots(self, *args: Any, **kwargs: Any) -> bool:
        return self.drafter.take_slots(*args, **kwargs)

    def forget(self, request_id: str) -> None:
        self.drafter.forget(request_id)

    def counts(self) -> SpeculativeCounts:
        return self.drafter.counts()


async def alternating(
    engine: AsyncEngine,
    drafter: Drafter,
    prompts: Sequence[Prompt],
    params: SamplingParams,
    streams: int,
    order: tuple[str, ...],
    seconds: float,
) -> dict[str, ModeTally]:
    """`streams` clients kept busy for at least `seconds` (plus `SETTLE_S`: a whole number of
    rounds of turns), the modes in `order` taking turns every second; each mode's tokens,
    seconds and drafts."""
    core = engine._core
    assert core is not None
    turns = Alternation(drafter, core.decode_runner.drafter, order)
    cycle = len(turns.turns) * turns.block_s
    seconds = math.ceil(seconds / cycle) * cycle
    core.scheduler.drafter = turns  # type: ignore[assignment]
    turns.count_until(seconds + SETTLE_S)
    try:
        await closed_loop(engine, prompts, params, streams, seconds + SETTLE_S)
    finally:
        core.scheduler.drafter = drafter
    return turns.tallies
