"""A shared prefix in flight is computed once, in both schedulers.

Requests arriving together with the same new prefix: the first computes it, the others wait for
its blocks and hit them (the prefill token counter proves it), without holding up unrelated
requests behind them; aborting the first hands what is left to a waiter. The fake runners check
that every hit reads the right KV, and every output equals the fake model's answer alone.
"""

from __future__ import annotations

import dataclasses

from deepinfer.cache.manager import KVCacheManager
from deepinfer.config import SchedulerConfig
from deepinfer.request import Request
from deepinfer.scheduler.disagg import DisaggScheduler
from deepinfer.scheduler.scheduler import Scheduler
from tests.scheduler.sched_fakes import FakeRunner, make_request, reference_output
from tests.scheduler.test_disagg import VOCAB, ConcurrentFakeRunner, planner_config

BS = 4
PREFIX = [(7 * i + 3) % VOCAB for i in range(64)]
"""16 full blocks shared by every request below."""


def shared_requests(n: int, tail: int = 3) -> list[Request]:
    """`n` requests: the shared prefix, then a tail of their own."""
    return [
        make_request(f"r{i}", [*PREFIX, *[(i * 5 + j) % VOCAB for j in range(tail)]], 4)
        for i in range(n)
    ]


def run_colocated(
    sched: Scheduler, runner: FakeRunner, requests: list[Request], abort_first_after: int = -1
) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for r in requests:
        sched.add_request(r)
    step = 0
    while sched.has_work:
        so = sched.schedule()
        sched.check_integrity()
        for delta in sched.update(so, runner.run(so)):
            outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
        sched.check_integrity()
        step += 1
        if step == abort_first_after:
            assert sched.abort(requests[0].request_id)
    return outputs


def test_colocated_shared_prefix_in_flight_is_computed_once() -> None:
    """All eight fit the first step's budget: seven wait for the first's blocks."""
    kv = KVCacheManager(256, BS, "m", True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=512), kv, max_model_len=128)
    requests = shared_requests(8)
    outputs = run_colocated(sched, FakeRunner(BS, VOCAB), requests)
    for r in requests:
        assert outputs[r.request_id] == reference_output(r, VOCAB), r.request_id
    counts = sched.prefill_counts()
    # the prefix once, then each request's own tail
    assert counts.num_computed_tokens == len(PREFIX) + 8 * 3
    assert counts.num_inflight_waits == 7
    assert counts.num_inflight_saved_tokens == 7 * len(PREFIX)
    assert all(r.num_cached_tokens == len(PREFIX) for r in requests[1:])


def test_colocated_without_the_wait_computes_it_eight_times() -> None:
    """The control: without prefix caching every request computes the prefix."""
    kv = KVCacheManager(256, BS, "m", False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=512), kv, max_model_len=128)
    run_colocated(sched, FakeRunner(BS, VOCAB), shared_requests(8))
    assert sched.prefill_counts().num_computed_tokens == 8 * (len(PREFIX) + 3)


def test_a_waiter_does_not_hold_up_unrelated_requests() -> None:
    kv = KVCacheManager(256, BS, "m", True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=40), kv, max_model_len=128)
    first, waiter = shared_requests(2)
    other = make_request("other", [1, 2, 3, 4, 5], 2)
    for r in (first, waiter, other):
        sched.add_request(r)
    so = sched.schedule()  # the budget goes to `first`'s first chunk
    assert [c.request_id for c in so.chunks] == ["r0"]
    sched.update(so, FakeRunner(BS, VOCAB).run(so))
    # `first` still computes the prefix: the waiter is passed over, `other` starts
    running = {c.request_id for c in sched.schedule().chunks}
    assert "other" in running and "r1" not in running
    assert [r.request_id for r in sched.waiting] == ["r1"]


def run_disagg(
    sched: DisaggScheduler, requests: list[Request], runner: ConcurrentFakeRunner | None = None
) -> dict[str, list[int]]:
    runner = runner or ConcurrentFakeRunner(BS)
    outputs: dict[str, list[int]] = {}
    for r in requests:
        sched.add_request(r)
    while sched.has_work:
        for lane in sched.lanes():
            if not lane.has_work:
                continue
            so = lane.schedule()
            sched.check_integrity()
            runner.start(so)
            for delta in lane.update(so, runner.finish(so)):
                outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
            sched.check_integrity()
    return outputs


def test_disaggregated_shared_prefix_in_flight_is_computed_once() -> None:
    kv = KVCacheManager(256, BS, "m", True)
    sched = DisaggScheduler(SchedulerConfig(), planner_config(BS, 16), kv, max_model_len=128)
    requests = shared_requests(8)
    outputs = run_disagg(sched, requests)
    for r in requests:
        assert outputs[r.request_id] == reference_output(r, VOCAB), r.request_id
    counts = sched.prefill_counts()
    assert counts.num_computed_tokens == len(PREFIX) + 8 * 3
    assert counts.num_inflight_saved_tokens == 7 * len(PREFIX)
    assert kv.num_used_blocks == 0


def test_abort_of_the_first_hands_the_prefix_to_a_waiter() -> None:
    """Two prefill steps into the shared prefix, the first request is aborted: a waiter takes
    over from the blocks already computed, and the third hits all of it."""
    kv = KVCacheManager(256, BS, "m", True)
    planner = dataclasses.replace(planner_config(BS, 16), max_num_batched_tokens=16)
    sched = DisaggScheduler(SchedulerConfig(), planner, kv, max_model_len=128)
    first, *waiters = shared_requests(3)
    for r in (first, *waiters):
        sched.add_request(r)
    prefill, _ = sched.lanes()
    runner = ConcurrentFakeRunner(BS)
    for _ in range(2):
        so = prefill.schedule()
        assert [c.request_id for c in so.chunks] == ["r0"], "the others wait for r0's blocks"
        runner.start(so)
        prefill.update(so, runner.finish(so))
    done = first.num_computed_tokens
    assert 0 < done < len(PREFIX)
    assert sched.abort("r0")
    outputs = run_disagg(sched, [], runner)
    for r in waiters:
        assert outputs[r.request_id] == reference_output(r, VOCAB), r.request_id
    assert waiters[0].num_cached_tokens == done and waiters[1].num_cached_tokens == len(PREFIX)
    assert sched.prefill_counts().num_computed_tokens == len(PREFIX) + 2 * 3
    assert kv.num_used_blocks == 0
