"""`DisaggScheduler`: two lanes with steps in flight at once, against the fake model.

A step's reads are checked when it starts (against the KV as it is then) and its writes land
when it finishes, so two overlapping steps are simulated as truly concurrent: neither may read or
write a slot the other writes. After every schedule and update: integrity. At the end: every
request not aborted produced exactly what the fake model generates for it alone, and no block
is leaked. The split-pool trials give decode its own KV pool (separate device groups): a KV copy
is ordered when a prompt is done and completed at a random later moment, and decoders read only
what the copy brought over.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from deepinfer.cache.manager import KVCacheManager
from deepinfer.config import SchedulerConfig
from deepinfer.outputs import RunnerOutput, SampledToken
from deepinfer.request import FinishReason, Request
from deepinfer.runner.speculative import verify_drafts
from deepinfer.scheduler.cost_model import CostCoefficients, CostModelConfig, StepCostModel
from deepinfer.scheduler.disagg import DisaggScheduler
from deepinfer.scheduler.draft_gate import DraftGate
from deepinfer.scheduler.drafting import Drafter
from deepinfer.scheduler.output import KVHandoff, ScheduleOutput, StepKind
from deepinfer.scheduler.prefill_types import PrefillPlannerConfig
from tests.scheduler.sched_fakes import (
    FakeProposer,
    fill_worker_drafts,
    make_request,
    next_token,
    prefix_digests,
    reference_output,
)
from tests.scheduler.test_randomized import MAX_REQUEST_TOKENS, VOCAB, random_requests

Slot = tuple[str, int, int]
"""(pool, block id, offset)"""


class ConcurrentFakeRunner:
    """Steps start (reads checked, writes computed) and finish (writes applied) separately.
    Decode steps read and write the `decode` pool when the pools are split."""

    def __init__(self, block_size: int, split_pools: bool = False) -> None:
        self.block_size = block_size
        self.pools = {StepKind.PREFILL: "prefill", StepKind.DECODE: "prefill"}
        if split_pools:
            self.pools[StepKind.DECODE] = "decode"
        self.kv: dict[Slot, tuple[int, int]] = {}
        self._pending: dict[StepKind, tuple[set[Slot], dict[Slot, tuple[int, int]], RunnerOutput]]
        self._pending = {}

    def start(self, so: ScheduleOutput) -> None:
        bs = self.block_size
        reads: set[Slot] = set()
        writes: dict[Slot, tuple[int, int]] = {}
        pool = self.pools[so.kind]
        picks: list[SampledToken] = []
        so, drafted = fill_worker_drafts(so, VOCAB)
        for chunk in so.chunks:
            context = chunk.request.all_token_ids[: chunk.start_position] + chunk.token_ids()
            digests = prefix_digests(context)  # drafts included: rejected ones write wrong KV
            table = chunk.block_ids
            assert 0 not in table and len(set(table)) == len(table)
            for p in range(chunk.start_position):
                slot = (pool, table[p // bs], p % bs)
                assert self.kv.get(slot) == (p, digests[p]), f"{chunk.request_id}: bad KV at {p}"
                reads.add(slot)
            for p in range(chunk.start_position, chunk.end_position):
                slot = (pool, table[p // bs], p % bs)
                assert slot not in writes, "two chunks of one step write one slot"
                writes[slot] = (p, digests[p])
            if chunk.sample:  # one pick per row of logits: the last token's, or every draft's
                rows = digests[len(digests) - chunk.num_logits :]
                picks += [SampledToken(next_token(d, VOCAB)) for d in rows]
        sampled, accepted = verify_drafts(so.chunks, picks)
        for other_reads, other_writes, _ in self._pending.values():
            assert not writes.keys() & (other_reads | other_writes.keys()), "steps collide"
            assert not reads & other_writes.keys(), "a step reads what another one writes"
        elapsed = 0.001 * len(writes) + 0.002
        out = RunnerOutput(so.step, sampled, elapsed, accepted, drafted)
        self._pending[so.kind] = (reads, writes, out)

    def finish(self, so: ScheduleOutput) -> RunnerOutput:
        _, writes, out = self._pending.pop(so.kind)
        self.kv.update(writes)
        return out

    def drop(self, so: ScheduleOutput) -> None:
        """The step failed before writing anything: its writes never land."""
        del self._pending[so.kind]

    def copy(self, handoff: KVHandoff, num_tokens: int) -> None:
        """The handoff's copy, while steps may be in flight: it reads only finished KV and
        writes only decode blocks no step touches."""
        written: set[Slot] = set()
        busy: set[Slot] = set()
        for reads, writes, _ in self._pending.values():
            written |= writes.keys()
            busy |= reads | writes.keys()
        bs = self.block_size
        assert len(handoff.src_block_ids) == len(handoff.dst_block_ids) == -(-num_tokens // bs)
        for p in range(num_tokens):
            src = ("prefill", handoff.src_block_ids[p // bs], p % bs)
            dst = ("decode", handoff.dst_block_ids[p // bs], p % bs)
            assert src in self.kv and src not in written and dst not in busy, "copy collides"
            self.kv[dst] = self.kv[src]


def planner_config(block_size: int, budget_tokens: int) -> PrefillPlannerConfig:
    return PrefillPlannerConfig(
        step_budget_ms=2.0 + budget_tokens,  # the fake step costs 1 ms per token + 2 ms
        boundaries=(8, 24),
        bucket_weights=(4.0, 2.0, 1.0),
        max_num_seqs=8,
        max_num_batched_tokens=64,
        chunk_align_tokens=block_size,
    )


def run_trial(
    seed: int,
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    abort_rate: float,
    split_pools: bool = False,
    speculative: bool = False,
    on_worker: bool = False,
):
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
        drafter=(
            Drafter(
                FakeProposer(rng, VOCAB, on_worker),
                DraftGate(StepCostModel(), enabled=seed % 2 == 0),
                5,
            )
            if speculative
            else None
        ),
    )
    prefill, decode = sched.lanes()
    runner = ConcurrentFakeRunner(block_size, split_pools)
    assert kv.capacity_tokens >= MAX_REQUEST_TOKENS
    requests = random_requests(rng, 24)
    if speculative:  # drafts are verified for greedy requests (the fake model is greedy)
        for r in requests:
            r.sampling = dataclasses.replace(r.sampling, temperature=0.0)
    pending, aborted, outputs = list(requests), set(), {}
    in_flight: dict[StepKind, ScheduleOutput] = {}
    copies: list[KVHandoff] = []
    for _ in range(20000):
        while pending and rng.random() < 0.3:
            sched.add_request(pending.pop(0))
        copies += sched.drain_handoffs()
        if not sched.has_work and not pending and not in_flight:
            break
        if copies and rng.random() < 0.3:
            handoff = copies.pop(rng.randrange(len(copies)))
            request = sched.handing_off[handoff.request_id]
            runner.copy(handoff, request.num_computed_tokens)
            sched.complete_handoff(handoff.request_id)
            sched.check_integrity()
            continue
        lane = rng.choice([prefill, decode])
        so = in_flight.pop(lane.kind, None)
        if so is None:
            so = lane.schedule()
            sched.check_integrity()
            assert so.plain_decodes == (lane.kind is StepKind.DECODE and _all_plain(so))
            runner.start(so)
            in_flight[lane.kind] = so
            continue
        out = runner.finish(so)
        if rng.random() < abort_rate and sched._requests:
            victim = rng.choice(sorted(sched._requests))
            assert sched.abort(victim)
            aborted.add(victim)
        for delta in lane.update(so, out):
            outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
            assert delta.num_output_tokens == len(outputs[delta.request_id])
        sched.check_integrity()
    else:
        raise AssertionError("requests did not all finish: starvation or deadlock")
    assert kv.num_used_blocks == 0, "blocks leaked"
    assert decode_kv is None or decode_kv.num_used_blocks == 0, "decode blocks leaked"
    return {
        r.request_id: (r, outputs.get(r.request_id))
        for r in requests
        if r.request_id not in aborted
    }, sched


def _all_plain(so: ScheduleOutput) -> bool:
    """Every chunk a one-token sampled decode of its request's last token, no drafts (the
    runner's lean path takes it on the flag's word)."""
    return all(
        c.num_new_tokens == 1
        and c.sample
        and not c.num_drafts
        and not c.window_block_ids
        and not c.cached_until
        and c.start_position == c.request.num_tokens - 1
        for c in so.chunks
    )


CONFIGS = [(4, 17, 8), (1, 61, 4), (2, 31, 16), (8, 9, 3), (16, 5, 4), (4, 40, 2), (4, 11, 16)]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("seed", range(4))
def test_concurrent_lanes_match_reference(config: tuple[int, int, int], seed: int) -> None:
    done, _ = run_trial(seed, *config, abort_rate=0.03)
    assert len(done) >= 12
    for req, got in done.values():
        assert got == reference_output(req, VOCAB) == req.output_token_ids, req.request_id
        assert req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(
    ("split_pools", "on_worker"), [(False, False), (True, False), (True, True)]
)
def test_speculative_decoding_matches_reference(
    config: tuple[int, int, int], split_pools: bool, on_worker: bool
) -> None:
    """Drafts of every quality verified in decode steps, aborts anywhere, tiny pools: the
    outputs are the fake model's own, every KV position read is right (a block holding a
    rejected draft's KV is never a prefix hit), and no block leaks."""
    seed = 2 + split_pools  # the gate is on for even seeds, off for odd ones
    done, sched = run_trial(
        seed,
        *config,
        abort_rate=0.03,
        split_pools=split_pools,
        speculative=True,
        on_worker=on_worker,
    )
    assert len(done) >= 12
    counts = sched.speculative_counts()
    assert counts.num_drafted > 0 and 0 < counts.num_accepted < counts.num_drafted
    for req, got in done.values():
        assert got == reference_output(req, VOCAB) == req.output_token_ids, req.request_id
        assert req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("seed", range(3))
def test_split_pools_match_reference(config: tuple[int, int, int], seed: int) -> None:
    """Separate prefill and decode pools, copies completing out of order, aborts anywhere."""
    done, sched = run_trial(seed, *config, abort_rate=0.03, split_pools=True)
    assert len(done) >= 12
    assert not sched.handing_off and not sched.handoff_waiting
    for req, got in done.values():
        assert got == reference_output(req, VOCAB) == req.output_token_ids, req.request_id
        assert req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


@pytest.mark.parametrize("split_pools", [False, True])
def test_tiny_pool_preempts_decoders_and_all_finish(split_pools: bool) -> None:
    total = 0
    for seed in range(6):
        done, sched = run_trial(seed, 4, 11, 16, abort_rate=0.0, split_pools=split_pools)
        assert len(done) == 24
        total += sched.num_preemptions
    assert total > 0, "the tiny pool was meant to force preemptions"


def _lone(rid: str, n: int, max_tokens: int = 4) -> Request:
    return make_request(rid, [(i * 7 + len(rid)) % VOCAB for i in range(n)], max_tokens=max_tokens)


def test_short_prompt_is_not_stuck_behind_a_long_one() -> None:
    """A long prompt is chunked to the step budget; a short one arriving meanwhile completes
    its prefill in the next prefill step and decodes while the long one is still prefilling."""
    kv = KVCacheManager(200, 4, "m", True)
    prior = CostCoefficients(step_s=0.002, token_s=0.001, attention_s=0.0)
    sched = DisaggScheduler(
        SchedulerConfig(max_num_seqs=8),
        planner_config(4, 8),
        kv,
        max_model_len=500,
        cost_model=StepCostModel(CostModelConfig(prior=prior)),
    )
    prefill, decode = sched.lanes()
    runner = ConcurrentFakeRunner(4)
    sched.add_request(_lone("long", 300))

    def prefill_step() -> ScheduleOutput:
        so = prefill.schedule()
        runner.start(so)
        prefill.update(so, runner.finish(so))
        return so

    first = prefill_step()
    assert first.chunks and first.num_batched_tokens < 300, "the long prompt is chunked"
    sched.add_request(_lone("short", 6))
    second = prefill_step()
    assert [c.request_id for c in second.chunks if c.sample] == ["short"]
    assert [r.request_id for r in sched.decoding] == ["short"]
    so = decode.schedule()
    runner.start(so)
    (delta,) = decode.update(so, runner.finish(so))
    assert delta.request_id == "short" and "long" in sched.prefilling
    sched.check_integrity()


def test_abort_of_an_in_flight_request_waits_for_its_step() -> None:
    kv = KVCacheManager(64, 4, "m", True)
    sched = DisaggScheduler(SchedulerConfig(), planner_config(4, 64), kv, max_model_len=100)
    prefill, _ = sched.lanes()
    runner = ConcurrentFakeRunner(4)
    sched.add_request(_lone("a", 10))
    so = prefill.schedule()
    runner.start(so)
    used = kv.num_used_blocks
    assert sched.abort("a")
    assert kv.num_used_blocks == used, "blocks freed under a running step"
    assert prefill.update(so, runner.finish(so)) == []
    assert kv.num_used_blocks == 0 and sched.get_request("a") is None
    sched.check_integrity()


def test_plain_decode_steps_cache_the_blocks_they_fill() -> None:
    """Decode steps of plain decodes (`apply_decodes`) register every block they fill: the
    next turn, whose prompt is the first's prompt and output, hits all of them."""
    kv = KVCacheManager(64, 4, "m", True)
    sched = DisaggScheduler(SchedulerConfig(), planner_config(4, 64), kv, max_model_len=100)
    prefill, decode = sched.lanes()
    runner = ConcurrentFakeRunner(4)
    first = _lone("a", 6, max_tokens=13)
    sched.add_request(first)
    while not first.is_finished:
        lane = decode if sched.decoding else prefill
        so = lane.schedule()
        assert so.plain_decodes == (lane is decode)
        runner.start(so)
        lane.update(so, runner.finish(so))
    assert first.num_tokens == 19
    second = _lone("b", 0, max_tokens=2)
    second.prompt_token_ids = [*first.prompt_token_ids, *first.output_token_ids]
    sched.add_request(second)
    prefill.schedule()
    assert second.num_cached_tokens == 16  # 4 full blocks of 19 tokens, 3 of them decoded
    sched.check_integrity()
