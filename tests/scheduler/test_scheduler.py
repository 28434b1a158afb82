"""Scheduler behaviour on hand-built cases, against the fake runner's simulated KV pool."""

from __future__ import annotations

import pytest

from deepinfer.cache.manager import KVCacheManager
from deepinfer.config import SchedulerConfig
from deepinfer.errors import ContextLengthError, InvalidRequestError, OverloadedError
from deepinfer.outputs import TokenDelta
from deepinfer.request import FinishReason, Request, RequestStatus
from deepinfer.scheduler.scheduler import Scheduler
from deepinfer.scheduler.stop import check_finished
from tests.scheduler.sched_fakes import FakeRunner, make_request, reference_output

VOCAB = 50


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 1024,
    caching: bool = True,
    max_waiting: int = 1024,
) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(num_blocks, block_size, "fp", caching)
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_waiting=max_waiting
    )
    return Scheduler(cfg, kv, max_model_len), FakeRunner(block_size, VOCAB)


def drive(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> list[TokenDelta]:
    deltas: list[TokenDelta] = []
    for _ in range(max_steps):
        if not sched.has_work:
            return deltas
        so = sched.schedule()
        sched.check_integrity()
        assert so.num_batched_tokens <= sched.max_num_batched_tokens
        deltas += sched.update(so, runner.run(so))
        sched.check_integrity()
    raise AssertionError("requests did not finish")


def test_single_request_matches_reference() -> None:
    sched, runner = make()
    req = make_request("a", range(1, 11), max_tokens=5)
    sched.add_request(req)
    deltas = drive(sched, runner)
    assert req.output_token_ids == reference_output(req, VOCAB)
    assert [d.token_ids[0] for d in deltas] == req.output_token_ids
    assert deltas[-1].finish_reason is FinishReason.LENGTH and deltas[-1].num_output_tokens == 5
    assert all(d.num_prompt_tokens == 10 and d.num_cached_tokens == 0 for d in deltas)
    assert sched.kv.num_used_blocks == 0 and req.status is RequestStatus.FINISHED


@pytest.mark.parametrize("prompt_len", [5, 39, 40, 41])
def test_prefix_hit_schedules_only_the_tail(prompt_len: int) -> None:
    sched, runner = make(block_size=4)
    prompt = [(7 * i) % 31 for i in range(prompt_len)]
    first = make_request("a", prompt, max_tokens=3)
    sched.add_request(first)
    drive(sched, runner)
    second = make_request("b", prompt, max_tokens=3)
    sched.add_request(second)
    so = sched.schedule()
    expected_hit = (prompt_len - 1) // 4 * 4
    assert second.num_cached_tokens == expected_hit
    (chunk,) = so.chunks
    assert (chunk.start_position, chunk.num_new_tokens) == (expected_hit, prompt_len - expected_hit)
    assert chunk.sample
    deltas = sched.update(so, runner.run(so)) + drive(sched, runner)
    assert second.output_token_ids == first.output_token_ids
    assert all(d.num_cached_tokens == expected_hit for d in deltas)


def test_salt_isolates_prefixes() -> None:
    sched, runner = make()
    prompt = list(range(20))
    sched.add_request(make_request("a", prompt, salt="tenant-1"))
    drive(sched, runner)
    other = make_request("b", prompt, salt="tenant-2")
    same = make_request("c", prompt, salt="tenant-1")
    sched.add_request(other)
    sched.add_request(same)
    drive(sched, runner)
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 16


def test_chunked_prefill_respects_budget() -> None:
    sched, runner = make(block_size=4, budget=16)
    req = make_request("a", range(50), max_tokens=2)
    sched.add_request(req)
    chunks = []
    while sched.has_work:
        so = sched.schedule()
        chunks += [(c.start_position, c.num_new_tokens, c.sample) for c in so.chunks]
        sched.update(so, runner.run(so))
        sched.check_integrity()
    assert chunks == [
        (0, 16, False),
        (16, 16, False),
        (32, 16, False),
        (48, 2, True),
        (50, 1, True),
    ]
    assert req.output_token_ids == reference_output(req, VOCAB)


def test_decodes_go_first_then_waiting_fill_the_budget() -> None:
    sched, runner = make(budget=10)
    a = make_request("a", range(8), max_tokens=4)
    sched.add_request(a)
    sched.update(so := sched.schedule(), runner.run(so))
    sched.add_request(make_request("b", range(100, 130), max_tokens=4))
    so = sched.schedule()
    assert [(c.request_id, c.num_new_tokens) for c in so.chunks] == [("a", 1), ("b", 9)]


def test_preemption_recomputes_and_keeps_outputs() -> None:
    # 6 usable blocks of 4 tokens: two requests of 12 prompt + 8 output cannot both fit.
    sched, runner = make(num_blocks=7, block_size=4, budget=64)
    reqs = [make_request(f"r{i}", range(i, i + 12), max_tokens=8) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    preempted: list[str] = []
    while sched.has_work:
        so = sched.schedule()
        preempted += so.preempted_ids
        sched.check_integrity()
        sched.update(so, runner.run(so))
        sched.check_integrity()
    assert preempted, "the pool was meant to force a preemption"
    assert sum(r.num_preemptions for r in reqs) == len(preempted)
    for r in reqs:
        assert r.output_token_ids == reference_output(r, VOCAB)
        assert r.finish_reason is FinishReason.LENGTH


def test_newest_running_is_preempted_first() -> None:
    sched, runner = make(num_blocks=5, block_size=2, budget=64)
    a, b = make_request("a", range(3), max_tokens=5), make_request("b", range(10, 13), max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(4):
        so = sched.schedule()
        if so.preempted_ids:
            break
        sched.update(so, runner.run(so))
    assert so.preempted_ids == ("b",)
    assert b.status is RequestStatus.PREEMPTED and sched.waiting[0] is b
    assert b.num_computed_tokens == 0 and sched.kv.num_blocks_of("b") == 0


def test_abort_waiting_and_running() -> None:
    sched, runner = make(max_num_seqs=1)
    a, b = make_request("a", range(9)), make_request("b", range(9))
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    assert sched.abort("b") and b.finish_reason is FinishReason.ABORT
    assert sched.abort("a") and sched.kv.num_used_blocks == 0
    assert sched.update(so, runner.run(so)) == []  # aborted while the step ran: skipped
    assert not sched.abort("a") and not sched.abort("nope")
    assert not sched.has_work
    sched.check_integrity()


def test_stop_tokens_min_tokens_and_ignore_eos() -> None:
    prompt = list(range(2, 8))
    probe = make_request("probe", prompt, max_tokens=6)
    tokens = reference_output(probe, VOCAB)
    assert len(set(tokens)) == 6, "the case table below assumes distinct tokens"
    eos = frozenset({tokens[2]})
    cases: list[tuple[Request, int, FinishReason]] = [
        (make_request("eos", prompt, 6, eos), 3, FinishReason.STOP),
        (make_request("min", prompt, 6, eos, min_tokens=3), 6, FinishReason.LENGTH),
        (make_request("ign", prompt, 6, eos, ignore_eos=True), 6, FinishReason.LENGTH),
        (make_request("ids", prompt, 6, stop_token_ids=(tokens[1],)), 2, FinishReason.STOP),
        (
            make_request("ign_ids", prompt, 6, eos, stop_token_ids=(tokens[4],), ignore_eos=True),
            5,
            FinishReason.STOP,
        ),
    ]
    for req, n, reason in cases:
        sched, runner = make()
        sched.add_request(req)
        drive(sched, runner)
        assert (len(req.output_token_ids), req.finish_reason) == (n, reason), req.request_id
        assert req.output_token_ids == tokens[:n]


def test_check_finished_on_context_end() -> None:
    req = make_request("a", range(10), max_tokens=100)
    req.output_token_ids = [1, 2, 3]
    assert check_finished(req, max_model_len=14) is None
    req.output_token_ids.append(4)
    assert check_finished(req, max_model_len=14) is FinishReason.LENGTH


def test_refusals() -> None:
    sched, _ = make(num_blocks=9, block_size=4, max_model_len=100, max_waiting=2)
    with pytest.raises(ContextLengthError):
        sched.add_request(make_request("long", range(95), max_tokens=10))
    with pytest.raises(ContextLengthError) as err:  # fits the context, not the 8-block pool
        sched.add_request(make_request("big", range(30), max_tokens=3))
    assert err.value.max_model_len == 32
    with pytest.raises(InvalidRequestError):
        sched.add_request(make_request("empty", []))
    sched.add_request(make_request("a", range(3)))
    with pytest.raises(InvalidRequestError):
        sched.add_request(make_request("a", range(3)))
    sched.add_request(make_request("b", range(3)))
    with pytest.raises(OverloadedError):
        sched.add_request(make_request("c", range(3)))


def test_request_filling_the_whole_pool_runs_alone() -> None:
    sched, runner = make(num_blocks=9, block_size=4, budget=7)
    big = make_request("big", range(30), max_tokens=2)
    small = make_request("small", range(40, 45), max_tokens=3)
    sched.add_request(small)
    sched.add_request(big)
    drive(sched, runner)
    assert big.output_token_ids == reference_output(big, VOCAB)
    assert small.output_token_ids == reference_output(small, VOCAB)


def test_freed_blocks_hit_until_evicted_lru() -> None:
    sched, runner = make(num_blocks=9, block_size=4)
    old = make_request("old", range(13), max_tokens=1)
    sched.add_request(old)
    drive(sched, runner)
    assert sched.kv.num_cached_blocks == 3 and sched.kv.num_used_blocks == 0
    # Unrelated work that needs 5 blocks: the 5 unhashed/least-recent blocks go first.
    filler = make_request("filler", range(100, 117), max_tokens=3)
    sched.add_request(filler)
    drive(sched, runner)
    again = make_request("again", range(13), max_tokens=1)
    sched.add_request(again)
    drive(sched, runner)
    assert again.num_cached_tokens == 12
    # Now something that needs every block evicts the old prefix.
    sched.add_request(make_request("huge", range(200, 230), max_tokens=2))
    drive(sched, runner)
    last = make_request("last", range(13), max_tokens=1)
    sched.add_request(last)
    drive(sched, runner)
    assert last.num_cached_tokens == 0
    assert last.output_token_ids == old.output_token_ids
