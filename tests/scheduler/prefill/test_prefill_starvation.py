"""Fairness under adversarial arrivals: short prompts are not held up by long ones, and no
bucket starves, with the planner learning the fake device's cost as it goes."""

from __future__ import annotations

import random

import pytest

from deepinfer.scheduler.cost_model import CostCoefficients, CostModelConfig, StepCostModel
from deepinfer.scheduler.prefill_planner import PrefillPlanner
from deepinfer.scheduler.prefill_types import PrefillPlannerConfig, PrefillView
from tests.scheduler.prefill.prefill_fakes import GroundTruth, Trace, check_plan, drive

PRIOR = CostCoefficients(step_s=3e-3, token_s=2e-5, attention_s=1e-9)


def _planner(**kwargs: object) -> PrefillPlanner:
    config = PrefillPlannerConfig(**kwargs)
    return PrefillPlanner(config, StepCostModel(CostModelConfig(prior=PRIOR)))


def _drain(planner: PrefillPlanner, truth: GroundTruth, trace: Trace, max_steps: int) -> None:
    """Run with no more arrivals until every request is planned in full."""
    drive(planner, truth, lambda step: [], max_steps, trace=trace, until_idle=True)
    assert not planner.has_work, f"still queued after {max_steps} drain steps"
    assert all(rt.done_step > 0 for rt in trace.requests.values())
    assert all(rt.num_planned_tokens == rt.num_tokens for rt in trace.requests.values())


def _every_waiting_bucket_served(trace: Trace) -> None:
    for plan, pending in zip(trace.plans, trace.pending_by_bucket, strict=True):
        served = {c.bucket for c in plan.chunks}
        assert set(pending) <= served, f"step {plan.step}: buckets {pending}, served {served}"


def _fifo_within_buckets(trace: Trace) -> None:
    by_bucket: dict[int, list[int]] = {}
    for rt in trace.requests.values():  # insertion order is arrival order
        by_bucket.setdefault(rt.bucket, []).append(rt.done_step)
    for bucket, done in by_bucket.items():
        assert done == sorted(done), f"bucket {bucket} finished out of arrival order"


def test_short_prompts_finish_next_step_under_a_long_flood() -> None:
    """Long and medium work never runs out; one short (<= 512 tokens) arrives most steps, at
    adversarial moments (right as a long chunk runs). Every short is planned in full in the
    step right after it arrives: it never waits behind long work."""
    rng = random.Random(7)
    counter = iter(range(10**6))

    def arrivals(step: int) -> list[PrefillView]:
        out = [PrefillView(f"s{step}", rng.randint(1, 512))] if rng.random() < 0.8 else []
        if step % 10 == 0:
            out += [PrefillView(f"L{next(counter)}", 60_000) for _ in range(2)]
            out.append(PrefillView(f"M{next(counter)}", 30_000))
            out.append(PrefillView(f"m{next(counter)}", 4000))
        return out

    planner = _planner()
    trace = drive(planner, GroundTruth(seed=7), arrivals, num_steps=300)
    shorts = [rt for rid, rt in trace.requests.items() if rid.startswith("s")]
    assert len(shorts) > 200
    assert all(rt.done_step == rt.added_step + 1 for rt in shorts)
    assert all(len(rt.chunk_steps) == 1 for rt in shorts)
    _every_waiting_bucket_served(trace)


def test_a_short_flood_never_starves_a_long_prompt() -> None:
    """Shorts arrive faster than the device can serve them; the long prompt still gets at
    least its guaranteed share (1/5 of the work budget, against the short bucket's 4/5) every
    step, less one aligned block, and finishes."""
    planner = _planner()
    model = planner.cost_model
    truth = GroundTruth(seed=8)
    planner.add(PrefillView("long", 40_000))
    rng = random.Random(8)
    num_steps = 0
    while planner.stats().queue_depths[3]:
        for k in range(4):
            planner.add(PrefillView(f"s{num_steps}.{k}", rng.randint(256, 512)))
        work_s = planner.budget_s - model.step_overhead_s
        plan = planner.plan()
        check_plan(planner, plan)
        (chunk,) = [c for c in plan.chunks if c.request_id == "long"]
        got_s = model.chunk_cost_s(chunk.num_new_tokens, chunk.start_position)
        one_more_s = model.chunk_cost_s(16, chunk.end_position)
        assert chunk.is_last or got_s >= work_s / 5 - one_more_s - 1e-12
        planner.observe(plan, truth.measure_s(plan.shapes))
        num_steps += 1
        assert num_steps < 2000
    assert planner.stats().queue_depths[0] > 100, "the flood did outrun the device"


def test_a_long_prompt_beyond_any_share_is_served_by_the_backstop() -> None:
    """A chunk of a 2M-token prompt late in its prefill costs more than its share of a 20 ms
    step; the starvation backstop still gives it an aligned block every few steps."""
    planner = _planner(step_budget_ms=20.0, max_wait_steps=4)
    truth = GroundTruth(seed=9)
    planner.add(PrefillView("huge", 2_000_000, num_computed_tokens=1_000_000))
    rng = random.Random(9)
    served: list[int] = []
    for step in range(60):
        for k in range(3):
            planner.add(PrefillView(f"s{step}.{k}", rng.randint(300, 512)))
        plan = planner.plan()
        planner.check_integrity()
        check_plan(planner, plan)
        if any(c.request_id == "huge" for c in plan.chunks):
            served.append(plan.step)
            assert plan.forced
        planner.observe(plan, truth.measure_s(plan.shapes))
    gaps = [b - a for a, b in zip([0, *served], served, strict=False)]
    assert served and max(gaps) <= 5
    assert planner.stats().head_wait_steps[3] == 0


def test_a_small_seq_cap_still_serves_every_bucket() -> None:
    """Fewer request slots than buckets: the backstop rotates the slot-less bucket in."""
    planner = _planner(max_num_seqs=2, max_wait_steps=3)
    rng = random.Random(10)

    def arrivals(step: int) -> list[PrefillView]:
        sizes = [rng.randint(1, 512), rng.randint(513, 4096), rng.randint(4097, 8000)]
        return [PrefillView(f"b{i}.{step}", n) for i, n in enumerate(sizes)]

    trace = drive(planner, GroundTruth(seed=10), arrivals, num_steps=100)
    for bucket in range(3):
        steps = [p.step for p in trace.plans if any(c.bucket == bucket for c in p.chunks)]
        gaps = [b - a for a, b in zip([0, *steps], steps, strict=False)]
        assert max(gaps) <= 4, f"bucket {bucket} waited {max(gaps)} steps"


@pytest.mark.parametrize("seed", range(4))
def test_random_bursts_every_bucket_served_every_step(seed: int) -> None:
    """Bursts of every size at random moments, including floods of one size. At every step,
    every bucket with queued work gets a chunk; buckets finish in arrival order; all drains."""
    rng = random.Random(seed)
    ranges = [(1, 512), (513, 4096), (4097, 32768), (32769, 100_000)]
    burst_weights = [6, 3, 2, 1]

    def arrivals(step: int) -> list[PrefillView]:
        out = []
        if rng.random() < 0.3:
            bucket = rng.choices(range(4), weights=burst_weights)[0]
            for k in range(rng.randint(1, 8 if bucket == 0 else 2)):
                lo, hi = ranges[bucket]
                cached = rng.choice([0, 0, 16 * rng.randint(0, 100)])
                out.append(PrefillView(f"{step}.{k}", cached + rng.randint(lo, hi), cached))
        return out

    planner = _planner()
    truth = GroundTruth(seed=seed)
    trace = drive(planner, truth, arrivals, num_steps=150)
    _every_waiting_bucket_served(trace)
    _drain(planner, truth, trace, max_steps=3000)
    _fifo_within_buckets(trace)
