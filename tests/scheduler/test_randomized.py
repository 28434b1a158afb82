"""Randomized scheduling: arrivals, aborts, shared prefixes, tiny pools and budgets.

After every schedule and every update: cache and scheduler integrity, the token budget, and
(through the fake runner) the content of every KV position a chunk reads. At the end: every
request not aborted finished with exactly the tokens the fake model generates for it alone, so
preemption, chunking and prefix hits change nothing in the outputs.
"""

from __future__ import annotations

import random

import pytest

from deepinfer.cache.manager import KVCacheManager
from deepinfer.config import SchedulerConfig
from deepinfer.request import FinishReason, Request
from deepinfer.scheduler.cost_model import StepCostModel
from deepinfer.scheduler.draft_gate import DraftGate
from deepinfer.scheduler.drafting import Drafter
from deepinfer.scheduler.scheduler import Scheduler
from tests.scheduler.sched_fakes import FakeProposer, FakeRunner, make_request, reference_output

VOCAB = 40
EOS = frozenset({7})


MAX_REQUEST_TOKENS = 40
"""Prompt plus max_tokens of every generated request (fits every pool below)."""


def random_requests(rng: random.Random, n: int) -> list[Request]:
    bases = [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 30))] for _ in range(4)]
    reqs = []
    for i in range(n):
        base = rng.choice(bases)
        prompt = base[: rng.randint(len(base) // 2, len(base))]
        prompt += [rng.randrange(VOCAB) for _ in range(rng.choice([0, 0, 1, 5, 17]))]
        prompt = prompt[: MAX_REQUEST_TOKENS - 1] or [rng.randrange(VOCAB)]
        max_tokens = rng.randint(1, min(20, MAX_REQUEST_TOKENS - len(prompt)))
        salt = rng.choice([None, None, None, "t1", "t2"])
        reqs.append(
            make_request(
                f"r{i}",
                prompt,
                max_tokens=max_tokens,
                eos=EOS,
                salt=salt,
                min_tokens=rng.choice([0, 0, min(2, max_tokens)]),
                ignore_eos=rng.random() < 0.2,
            )
        )
    return reqs


def run_trial(
    seed: int,
    block_size: int,
    num_blocks: int,
    budget: int,
    max_num_seqs: int,
    caching: bool,
    abort_rate: float,
    gate: bool | None = None,
    on_worker: bool = False,
) -> tuple[dict[str, tuple[Request, list[int]]], int]:
    """`gate`: speculative decoding with drafts of every quality, the gate on or off (None:
    no drafts); `on_worker`: drafted by the runner (a model proposer's way)."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, block_size, f"model-{seed}", caching)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    drafter = None
    if gate is not None:
        proposer = FakeProposer(rng, VOCAB, on_worker)
        drafter = Drafter(proposer, DraftGate(StepCostModel(), enabled=gate), 5)
    sched = Scheduler(cfg, kv, max_model_len=60, drafter=drafter)
    runner = FakeRunner(block_size, VOCAB)
    assert kv.capacity_tokens >= MAX_REQUEST_TOKENS
    requests = random_requests(rng, 24)
    pending = list(requests)
    aborted: set[str] = set()
    outputs: dict[str, list[int]] = {}
    preemptions = 0
    for _step in range(5000):
        while pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if not sched.has_work and not pending:
            break
        so = sched.schedule()
        preemptions += len(so.preempted_ids)
        sched.check_integrity()
        assert so.num_batched_tokens <= budget
        assert len({c.request_id for c in so.chunks}) == len(so.chunks)
        assert not (so.is_empty and sched.num_running), "running requests made no progress"
        out = runner.run(so)
        if rng.random() < abort_rate and sched.running + list(sched.waiting):
            victim = rng.choice(sched.running + list(sched.waiting))
            assert sched.abort(victim.request_id)
            aborted.add(victim.request_id)
        for delta in sched.update(so, out):
            outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
            assert delta.num_output_tokens == len(outputs[delta.request_id])
        sched.check_integrity()
    else:
        raise AssertionError("requests did not all finish: starvation or deadlock")
    assert kv.num_used_blocks == 0
    done = {
        r.request_id: (r, outputs[r.request_id]) for r in requests if r.request_id not in aborted
    }
    return done, preemptions


CONFIGS = [
    # block_size, num_blocks, budget, max_num_seqs, caching
    (4, 17, 64, 8, True),
    (4, 17, 64, 8, False),
    (1, 61, 7, 4, True),
    (2, 31, 5, 16, True),
    (8, 9, 16, 3, True),
    (16, 5, 32, 4, True),
    (4, 40, 3, 2, True),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("seed", range(4))
def test_random_schedules_match_reference(
    config: tuple[int, int, int, int, bool], seed: int
) -> None:
    done, _ = run_trial(seed, *config, abort_rate=0.05)
    assert len(done) >= 12
    for req, got in done.values():
        assert got == reference_output(req, VOCAB) == req.output_token_ids, req.request_id
        assert req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(("gate", "on_worker"), [(True, False), (False, False), (True, True)])
def test_speculative_decoding_matches_reference(
    config: tuple[int, int, int, int, bool], gate: bool, on_worker: bool
) -> None:
    """Colocated steps verifying drafts of every quality (within the token budget, never
    preempting for them; drafted by the proposer or by the runner), aborts anywhere, tiny pools:
    the outputs are the fake model's own, every KV position read is right (a rejected draft's KV
    is never a prefix hit), and no block leaks."""
    done, _ = run_trial(5, *config, abort_rate=0.05, gate=gate, on_worker=on_worker)
    assert len(done) >= 12
    for req, got in done.values():
        assert got == reference_output(req, VOCAB) == req.output_token_ids, req.request_id
        assert req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_tiny_pool_forces_preemption_and_all_finish() -> None:
    total = 0
    for seed in range(6):
        done, preemptions = run_trial(seed, 4, 11, 64, 16, True, abort_rate=0.0)
        total += preemptions
        assert len(done) == 24
    assert total > 0, "the tiny pool was meant to force preemptions"


def test_outputs_identical_across_configs() -> None:
    """Same requests, no aborts: a roomy run and a tiny-budget, tiny-pool run agree exactly."""
    runs = [
        run_trial(3, 4, 200, 512, 64, True, abort_rate=0.0),
        run_trial(3, 4, 11, 3, 16, True, abort_rate=0.0),
        run_trial(3, 4, 11, 3, 16, False, abort_rate=0.0),
        run_trial(3, 1, 41, 1, 1, True, abort_rate=0.0),
    ]
    assert runs[1][1] > 0, "the tight run was meant to preempt"
    roomy = {rid: got for rid, (_, got) in runs[0][0].items()}
    for done, _ in runs[1:]:
        assert {rid: got for rid, (_, got) in done.items()} == roomy
