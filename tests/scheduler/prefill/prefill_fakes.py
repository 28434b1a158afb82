"""A fake prefill runner whose step time follows a hidden ground truth, and a driver loop.

The ground truth is deliberately not the cost model's exact form: attention counts the exact
causal pairs `n * ctx + n * (n + 1) / 2` and the noise is multiplicative (log-normal), as real
timings are. The planner only ever sees measured times.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from deepinfer.scheduler.cost_model import ChunkShape
from deepinfer.scheduler.prefill_planner import PrefillPlanner
from deepinfer.scheduler.prefill_types import PrefillPlan, PrefillView


@dataclass
class GroundTruth:
    step_s: float = 4e-3
    token_s: float = 3e-5
    attention_s: float = 1.5e-9
    kv_token_s: float = 0.0
    """Per context token each chunk reads (KV gather), whatever the chunk's length."""
    noise: float = 0.03
    """Standard deviation of the log of the multiplicative noise."""
    seed: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def exact_s(self, shapes: Sequence[ChunkShape]) -> float:
        if not shapes:
            return 0.0
        tokens = sum(c.num_new_tokens for c in shapes)
        pairs = sum(
            c.num_new_tokens * c.context_before + c.num_new_tokens * (c.num_new_tokens + 1) / 2
            for c in shapes
        )
        kv_tokens = sum(c.context_before + c.num_new_tokens for c in shapes)
        return (
            self.step_s
            + self.token_s * tokens
            + self.attention_s * pairs
            + self.kv_token_s * kv_tokens
        )

    def measure_s(self, shapes: Sequence[ChunkShape]) -> float:
        return self.exact_s(shapes) * math.exp(self.rng.gauss(0.0, self.noise))


@dataclass
class RequestTrace:
    bucket: int
    num_tokens: int
    added_step: int
    """Plans made before the request was added (its first chance is plan added_step + 1)."""
    chunk_steps: list[int] = field(default_factory=list)
    num_planned_tokens: int = 0
    done_step: int = -1

    @property
    def first_wait_steps(self) -> int:
        """Plans until its first chunk (1: planned in the very next step)."""
        return self.chunk_steps[0] - self.added_step


@dataclass
class Trace:
    requests: dict[str, RequestTrace] = field(default_factory=dict)
    plans: list[PrefillPlan] = field(default_factory=list)
    measured_s: list[float] = field(default_factory=list)
    pending_by_bucket: list[tuple[int, ...]] = field(default_factory=list)
    """Per plan: the buckets that had queued work just before it."""


Arrivals = Callable[[int], list[PrefillView]]
"""Step number (plans made so far) -> requests arriving before the next plan."""


def drive(
    planner: PrefillPlanner,
    truth: GroundTruth,
    arrivals: Arrivals,
    num_steps: int,
    trace: Trace | None = None,
    until_idle: bool = False,
) -> Trace:
    """Run `num_steps` plan/run/observe cycles (fewer with `until_idle`: stop once nothing is
    queued), checking plan-level invariants every step. Extends `trace` when given."""
    trace = trace or Trace()
    for _ in range(num_steps):
        for view in arrivals(planner.step):
            bucket = planner.add(view)
            trace.requests[view.request_id] = RequestTrace(
                bucket, view.num_tokens - view.num_computed_tokens, planner.step
            )
        if until_idle and not planner.has_work:
            break
        trace.pending_by_bucket.append(
            tuple(i for i, d in enumerate(planner.stats().queue_depths) if d)
        )
        plan = planner.plan()
        planner.check_integrity()
        check_plan(planner, plan)
        for c in plan.chunks:
            rt = trace.requests[c.request_id]
            rt.chunk_steps.append(plan.step)
            rt.num_planned_tokens += c.num_new_tokens
            if c.is_last:
                assert rt.num_planned_tokens == rt.num_tokens, "prefill planned twice or short"
                rt.done_step = plan.step
        measured = truth.measure_s(plan.shapes)
        planner.observe(plan, measured)
        trace.plans.append(plan)
        trace.measured_s.append(measured)
    return trace


def check_plan(planner: PrefillPlanner, plan: PrefillPlan) -> None:
    cfg = planner.config
    ids = [c.request_id for c in plan.chunks]
    assert len(ids) == len(set(ids)), "two chunks of one request in a step"
    assert len(ids) <= cfg.max_num_seqs or plan.forced
    assert plan.num_batched_tokens <= cfg.max_num_batched_tokens or plan.forced
    assert [c.bucket for c in plan.chunks] == sorted(c.bucket for c in plan.chunks)
    if not plan.forced:
        assert plan.predicted_s <= plan.budget_s * (1 + 1e-9), "plan over its budget"
    for c in plan.chunks:
        assert c.num_new_tokens > 0
        if not c.is_last:
            assert c.end_position % cfg.chunk_align_tokens == 0, f"unaligned chunk {c}"
