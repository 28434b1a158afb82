"""`StepLane.fail`: a failed step finishes its own requests and nothing else.

Randomized trials fail some steps, either before their forward pass wrote anything (the fake
runner's writes never land, so a block of a failed step registered in the prefix cache would be
read back wrong by a later hit) or in an update that raises part way (a sampled token missing).
After every operation: integrity. At the end: no block is held, every failed request finished
with ERROR, and every other request produced exactly what the fake model generates for it alone.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from deepinfer.cache.manager import KVCacheManager
from deepinfer.config import SchedulerConfig
from deepinfer.outputs import RunnerOutput
from deepinfer.request import FinishReason, Request
from deepinfer.scheduler.cost_model import CostCoefficients, CostModelConfig, StepCostModel
from deepinfer.scheduler.disagg import DisaggScheduler
from deepinfer.scheduler.output import KVHandoff, ScheduleOutput, StepKind
from deepinfer.scheduler.protocol import StepLane
from deepinfer.scheduler.scheduler import Scheduler
from tests.scheduler.sched_fakes import FakeRunner, make_request, reference_output
from tests.scheduler.test_disagg import ConcurrentFakeRunner, planner_config
from tests.scheduler.test_randomized import MAX_REQUEST_TOKENS, VOCAB, random_requests


def without_one_token(rng: random.Random, missing: list[str], out: RunnerOutput) -> RunnerOutput:
    """`out` missing one of the `missing` sampled tokens: the step's update raises part way."""
    missing = rng.choice(missing)
    sampled = {rid: t for rid, t in out.sampled.items() if rid != missing}
    return RunnerOutput(step=out.step, sampled=sampled)


def fail_step(
    rng: random.Random,
    lane: StepLane,
    so: ScheduleOutput,
    run: Callable[[ScheduleOutput], RunnerOutput],
    drop: Callable[[ScheduleOutput], None],
    aborted: set[str],
) -> list[str]:
    """Fail `so`: its update raises part way (when it samples a request not aborted, half the
    time), or its forward pass failed before writing (`drop`)."""
    sampled = [c.request_id for c in so.chunks if c.sample and c.request_id not in aborted]
    if sampled and rng.random() < 0.5:
        with pytest.raises(KeyError):
            lane.update(so, without_one_token(rng, sampled, run(so)))
    else:
        drop(so)
    failed = lane.fail(so)
    assert len(set(failed)) == len(failed) <= len(so.chunks)
    for chunk in so.chunks:
        reason = chunk.request.finish_reason
        assert reason in (FinishReason.ERROR, FinishReason.ABORT), chunk.request_id
        assert (reason is FinishReason.ERROR) == (chunk.request_id in failed)
    return failed


def check_outcome(
    requests: list[Request], outputs: dict[str, list[int]], failed: set[str], aborted: set[str]
) -> None:
    assert failed, "the trial was meant to fail some steps"
    for req in requests:
        if req.request_id in failed:
            assert req.finish_reason is FinishReason.ERROR and req.request_id not in aborted
        elif req.request_id not in aborted:
            got = outputs.get(req.request_id)
            assert got == reference_output(req, VOCAB) == req.output_token_ids, req.request_id
            assert req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def colocated_trial(
    seed: int, block_size: int, num_blocks: int, budget: int, max_num_seqs: int
) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, block_size, f"model-{seed}", True)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    sched = Scheduler(cfg, kv, max_model_len=60)
    runner = FakeRunner(block_size, VOCAB)
    assert kv.capacity_tokens >= MAX_REQUEST_TOKENS
    requests = random_requests(rng, 24)
    pending, failed, outputs = list(requests), set[str](), dict[str, list[int]]()
    for _ in range(5000):
        while pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if not sched.has_work and not pending:
            break
        so = sched.schedule()
        sched.check_integrity()
        if so.chunks and rng.random() < 0.15:
            failed.update(fail_step(rng, sched, so, runner.run, lambda _: None, set()))
        else:
            for delta in sched.update(so, runner.run(so)):
                outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
        sched.check_integrity()
    else:
        raise AssertionError("requests did not all finish")
    assert kv.num_used_blocks == 0, "blocks leaked"
    check_outcome(requests, outputs, failed, set())


@pytest.mark.parametrize("config", [(4, 17, 64, 8), (1, 61, 7, 4), (8, 9, 16, 3), (4, 11, 3, 16)])
@pytest.mark.parametrize("seed", range(3))
def test_colocated_failed_steps_fail_only_their_requests(
    config: tuple[int, int, int, int], seed: int
) -> None:
    colocated_trial(seed, *config)


def disagg_trial(
    seed: int, block_size: int, num_blocks: int, max_num_seqs: int, split_pools: bool
) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, block_size, f"model-{seed}", True)
    decode_kv = KVCacheManager(num_blocks, block_size, "decode", False) if split_pools else None
    prior = CostCoefficients(step_s=0.002, token_s=0.001, attention_s=0.0)
    sched = DisaggScheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs),
        planner_config(block_size, rng.choice([3, 8, 20])),
        kv,
        max_model_len=60,
        cost_model=StepCostModel(CostModelConfig(prior=prior)),
        decode_kv=decode_kv,
    )
    lanes = sched.lanes()
    runner = ConcurrentFakeRunner(block_size, split_pools)
    requests = random_requests(rng, 24)
    pending, failed, aborted = list(requests), set[str](), set[str]()
    outputs: dict[str, list[int]] = {}
    in_flight: dict[StepKind, ScheduleOutput] = {}
    copies: list[KVHandoff] = []
    kinds = {StepKind.PREFILL: 0, StepKind.DECODE: 0}
    busy = dict.fromkeys(kinds, 0)
    for _ in range(20000):
        while pending and rng.random() < 0.3:
            sched.add_request(pending.pop(0))
        copies += sched.drain_handoffs()
        if not sched.has_work and not pending and not in_flight:
            break
        if copies and rng.random() < 0.3:
            handoff = copies.pop(rng.randrange(len(copies)))
            runner.copy(handoff, sched.handing_off[handoff.request_id].num_computed_tokens)
            sched.complete_handoff(handoff.request_id)
            sched.check_integrity()
            continue
        lane = rng.choice(lanes)
        so = in_flight.pop(lane.kind, None)
        if so is None:
            so = lane.schedule()
            sched.check_integrity()
            runner.start(so)
            in_flight[lane.kind] = so
            continue
        if rng.random() < 0.03 and sched._requests:  # an abort while the step runs
            victim = rng.choice(sorted(sched._requests))
            assert sched.abort(victim)
            aborted.add(victim)
        busy[lane.kind] += bool(so.chunks)
        first_failure_due = not kinds[lane.kind] and busy[lane.kind] == 3  # each lane fails
        if so.chunks and (rng.random() < 0.15 or first_failure_due):
            failed.update(fail_step(rng, lane, so, runner.finish, runner.drop, aborted))
            kinds[lane.kind] += 1
        else:
            for delta in lane.update(so, runner.finish(so)):
                outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
        sched.check_integrity()
    else:
        raise AssertionError("requests did not all finish")
    assert kv.num_used_blocks == 0, "blocks leaked"
    assert decode_kv is None or decode_kv.num_used_blocks == 0, "decode blocks leaked"
    assert not sched._deferred_aborts and not sched._in_flight
    assert all(kinds.values()), "both lanes were meant to fail steps"
    check_outcome(requests, outputs, failed, aborted)


@pytest.mark.parametrize("config", [(4, 17, 8), (1, 61, 4), (8, 9, 3), (4, 11, 16)])
@pytest.mark.parametrize("split_pools", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_disaggregated_failed_steps_fail_only_their_requests(
    config: tuple[int, int, int], split_pools: bool, seed: int
) -> None:
    disagg_trial(seed, *config, split_pools=split_pools)


def test_colocated_failed_prefill_registers_nothing() -> None:
    kv = KVCacheManager(32, 4, "m", True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, max_model_len=100)
    prompt = list(range(1, 14))  # three full blocks and one token
    sched.add_request(make_request("a", prompt))
    so = sched.schedule()
    assert sched.fail(so) == ["a"]
    assert kv.num_used_blocks == 0 and kv.num_cached_blocks == 0
    sched.check_integrity()
    sched.add_request(make_request("b", prompt))
    (chunk,) = sched.schedule().chunks
    assert chunk.start_position == 0, "a prefix hit on blocks of the failed step"


@pytest.mark.parametrize("split_pools", [False, True])
def test_disaggregated_failed_lanes_register_nothing(split_pools: bool) -> None:
    """A failed prefill step registers nothing; a failed decode step leaves the prefill lane
    and its in-flight step untouched."""
    kv = KVCacheManager(64, 4, "m", True)
    decode_kv = KVCacheManager(64, 4, "d", False) if split_pools else None
    sched = DisaggScheduler(
        SchedulerConfig(), planner_config(4, 64), kv, max_model_len=100, decode_kv=decode_kv
    )
    prefill, decode = sched.lanes()
    prompt = list(range(1, 14))
    sched.add_request(make_request("a", prompt))
    so = prefill.schedule()
    assert prefill.fail(so) == ["a"]
    assert kv.num_used_blocks == 0 and kv.num_cached_blocks == 0
    sched.check_integrity()
    runner = ConcurrentFakeRunner(4, split_pools)
    sched.add_request(make_request("b", prompt, max_tokens=20))
    so = prefill.schedule()
    assert so.chunks[0].start_position == 0, "a prefix hit on blocks of the failed step"
    runner.start(so)
    prefill.update(so, runner.finish(so))
    for handoff in sched.drain_handoffs():
        runner.copy(handoff, len(prompt))
        sched.complete_handoff(handoff.request_id)
    sched.add_request(make_request("c", [*prompt, 99]))
    decode_so = decode.schedule()
    prefill_so = prefill.schedule()
    runner.start(decode_so)
    runner.start(prefill_so)
    runner.drop(decode_so)
    assert decode.fail(decode_so) == ["b"]
    sched.check_integrity()
    prefill.update(prefill_so, runner.finish(prefill_so))
    sched.check_integrity()
    assert prefill_so.chunks[0].start_position == 12, "c hits the blocks b computed"
    assert sched.get_request("c") is not None and sched.get_request("b") is None
