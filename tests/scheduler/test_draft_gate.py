"""The confidence gate: its rates and its logistic model converge on synthetic acceptance
streams (and its calibration buckets say so), and it verifies only the drafts that pay."""

from __future__ import annotations

import math
import random
import time

from deepinfer.request import Request
from deepinfer.scheduler.cost_model import (
    ChunkShape,
    CostCoefficients,
    CostModelConfig,
    StepCostModel,
)
from deepinfer.scheduler.draft_gate import (
    EXPLORE_EVERY,
    MAX_BACKOFF,
    AcceptanceModel,
    Draft,
    DraftGate,
)
from deepinfer.scheduler.drafting import Drafter, LoopOverhead
from deepinfer.scheduler.speculative import NgramProposer
from tests.scheduler.sched_fakes import make_request


def _gate(step_s: float = 8e-3, token_s: float = 1.5e-3, num_signals: int = 0) -> DraftGate:
    prior = CostCoefficients(step_s=step_s, token_s=token_s, attention_s=0.0)
    return DraftGate(StepCostModel(CostModelConfig(prior=prior)), num_signals)


def _drafts(n: int, signal: float | None = None) -> Draft:
    return Draft(tuple(range(n)), () if signal is None else (signal,))


def _verify(gate: DraftGate, rid: str, draft: Draft, accepts: list[bool]) -> None:
    """One step verifying all of `draft` (the gate off decides nothing), accepted while
    `accepts` says so."""
    request = make_request(rid, [1] * 40)
    enabled, gate.enabled = gate.enabled, False
    gate.choose([(request, draft)])
    gate.enabled = enabled
    accepted = 0
    while accepted < len(draft.token_ids) and accepts[accepted]:
        accepted += 1
    gate.observe(rid, len(draft.token_ids), accepted)


def test_gate_rates_converge_on_synthetic_acceptance_streams() -> None:
    """Each request's drafts accepted position by position with its own probability: the
    gate's recent rates average near them, and its predictions land near them."""
    rng = random.Random(0)
    gate = _gate()
    truth = {"easy": 0.85, "hard": 0.15}
    seen: dict[str, list[float]] = {rid: [] for rid in truth}
    for step in range(400):
        for rid, p in truth.items():
            _verify(gate, rid, _drafts(5), [rng.random() < p for _ in range(5)])
            if step >= 100:
                seen[rid].append(gate.rate(rid))
    for rid, p in truth.items():
        mean = sum(seen[rid]) / len(seen[rid])  # pulled a little toward the global rate
        assert abs(mean - p) < 0.1, (rid, mean)
        predicted = gate.acceptance(rid, _drafts(1))[0]  # shrunk a little toward the others
        assert abs(predicted - p) < 0.12, (rid, predicted)
    assert 0.15 < gate.rate("new") < 0.85  # a new request starts from the global rate


def test_logistic_model_learns_signals_and_positions() -> None:
    """Acceptance that grows with the match length and falls with the position, the same for
    every request: the model's predictions come to follow it, and its calibration buckets
    agree with what was observed."""
    rng = random.Random(1)
    gate = _gate(num_signals=1)

    def truth(j: int, signal: float) -> float:
        return 1 / (1 + math.exp(-(-1.0 + 3.0 * signal - 1.5 * j / 4)))

    for step in range(8000):
        signal = rng.choice([0.5, 0.75, 1.0])
        accepts = [rng.random() < truth(j, signal) for j in range(5)]
        _verify(gate, f"r{step % 50}", _drafts(5, signal), accepts)
        if step == 3999:
            learning = gate.model.calibration()
    for signal in (0.5, 0.75, 1.0):
        for j in range(5):
            x = gate.features("new", j, (signal,))
            # the later positions of weak matches are seldom reached: fewer observations
            tolerance = 0.06 if j < 3 else 0.13
            assert abs(gate.model.predict(x) - truth(j, signal)) < tolerance, (signal, j)
    assert gate.model.weights[3] > 1.5 and gate.model.weights[2] < -0.7
    # the buckets are counters since start: the second half's are the later minus the earlier
    late = [
        (b.lower, b.num_trials - a.num_trials, b.predicted - a.predicted, b.accepted - a.accepted)
        for a, b in zip(learning, gate.model.calibration(), strict=True)
    ]
    buckets = [b for b in late if b[1] >= 300]
    assert len(buckets) >= 3
    for lower, n, predicted, accepted in buckets:
        assert lower <= predicted / n < lower + 0.1
        assert abs(accepted / n - predicted / n) < 0.06, (lower, n, predicted, accepted)


def test_model_starts_from_the_request_rate() -> None:
    model = AcceptanceModel(num_signals=2)
    for p in (0.1, 0.5, 0.9):
        x = [1.0, math.log(p / (1 - p)), 0.5, 0.3, 0.7]
        assert abs(model.predict(x) - p) < 1e-9


def test_gate_verifies_what_pays_for_its_rows() -> None:
    gate = _gate()
    easy, hard = make_request("easy", [1] * 40), make_request("hard", [2] * 40)
    for _ in range(200):
        _verify(gate, "easy", _drafts(5), [True] * 5)
        _verify(gate, "hard", _drafts(5), [False] * 5)
    assert gate.choose([(easy, _drafts(5))]) == [5]  # alone: a weight pass costs, rows are cheap
    assert gate.choose([(hard, _drafts(5))]) == [0]  # drafts that always fail are never verified
    assert gate.choose([(easy, _drafts(5)), (hard, _drafts(3))]) == [5, 0]
    assert gate.choose([(easy, Draft())]) == [0]
    assert gate.worth_proposing([easy, hard]) == [True, False]  # never asked for hard's drafts
    # ... but now and then it looks again, and verifies one (its drafts always failed: after
    # the longest wait)
    for _ in range(EXPLORE_EVERY * MAX_BACKOFF - 2):
        assert gate.worth_proposing([hard]) == [False]
    assert gate.worth_proposing([hard]) == [True]
    assert gate.choose([(hard, _drafts(5))]) == [1]
    assert gate.worth_proposing([hard]) == [False]
    # 32 streams of middling drafts: each row costs as much as the step's tokens earn
    middling = [make_request(f"m{i}", [3] * 40) for i in range(32)]
    rng = random.Random(0)
    for r in middling:
        for _ in range(50):
            _verify(gate, r.request_id, _drafts(5), [rng.random() < 0.5 for _ in range(5)])
    assert gate.choose([(middling[0], _drafts(5))])[0] > 0  # alone, half-right drafts pay
    assert sum(gate.choose([(r, _drafts(5)) for r in middling])) == 0  # beside 31, they do not
    off = DraftGate(StepCostModel(), enabled=False)
    assert off.choose([(hard, _drafts(4)), (easy, _drafts(2))]) == [4, 2]


def test_a_proposers_own_time_counts_against_a_first_draft() -> None:
    """A draft that pays for its row is not asked for where the proposal itself costs more
    than the step's tokens a second leave room for."""
    gate = _gate()
    easy = make_request("easy", [1] * 40)
    for _ in range(200):
        _verify(gate, "easy", _drafts(5), [True] * 5)
    costs = gate.cost_model_for(1)
    row_s = costs.row_cost_s(2, easy.num_computed_tokens)
    assert gate.worth_proposing([easy]) == [True]
    assert gate.worth_proposing([easy], propose_s=row_s / 10) == [True]
    assert gate.worth_proposing([easy], propose_s=1.0) == [False]


def _steps_to_look(gate: DraftGate, request: Request) -> int:
    """Steps until the gate looks at a turned-down request's drafts again (then it does)."""
    steps = 1
    while gate.worth_proposing([request]) == [False]:
        steps += 1
    assert gate.choose([(request, _drafts(5))]) == [1]
    return steps


def test_a_look_that_fails_doubles_the_wait_for_the_next() -> None:
    gate = _gate()
    hard = make_request("hard", [2] * 40)
    for _ in range(50):
        gate.observe("other", 5, 0)  # the proposer's drafts fail: no request is worth drafting
    assert gate.worth_proposing([hard]) == [False]
    waits = []
    for _ in range(5):
        waits.append(_steps_to_look(gate, hard))
        gate.observe("hard", 1, 0)
    e = EXPLORE_EVERY
    assert waits == [e - 1, 2 * e, 4 * e, 8 * e, 8 * e]
    gate.forget("hard")  # a new request with the same id waits the first wait again
    assert _steps_to_look(gate, hard) == e


def test_the_loop_around_a_step_makes_drafts_worth_more() -> None:
    """A step costs its forward pass and the loop around it: a draft that does not pay for its
    row against the forward alone pays when each step saved also saves the loop's time."""
    gate = _gate(step_s=1e-3, token_s=2e-3)
    request = make_request("r", [1] * 40)
    pattern = [True, False, True, True, False]  # accepted 3 times in 5
    for i in range(400):
        _verify(gate, "r", _drafts(1), [pattern[i % 5]])
    q = gate.acceptance("r", _drafts(1))[0]
    assert 0.45 < q < 0.75
    assert gate.choose([(request, _drafts(1))]) == [0]  # q tokens for 2 ms < 1 for 3 ms
    gate.loop_s = 3e-3
    assert gate.choose([(request, _drafts(1))]) == [1]  # q tokens for 2 ms > 1 for 6 ms


def test_loop_overhead_is_the_median_gap_outside_the_runner() -> None:
    now = [0.0]
    loop = LoopOverhead(clock=lambda: now[0])
    loop.planned()
    assert loop.seconds == 0.0  # nothing applied yet
    for gap, runner_s in [(5e-3, 4e-3), (5.5e-3, 4e-3), (0.5, 4e-3), (5.2e-3, 4e-3)]:
        loop.applied(runner_s)
        now[0] += gap
        loop.planned()
    # outside the runner: 1 ms, 1.5 ms, an idle lane (capped at the step's 4 ms), 1.2 ms
    assert abs(loop.seconds - 1.35e-3) < 1e-12
    loop.planned()  # planned again without a step applied between: nothing measured
    assert abs(loop.seconds - 1.35e-3) < 1e-12


def test_each_batch_size_range_has_its_own_cost_model() -> None:
    """Steps of one decoder teach nothing to the model of steps of eight: alone, the first rows
    share a read of the weights; beside others, each row pays its arithmetic."""
    gate = _gate()
    one, eight = gate.cost_model_for(1), gate.cost_model_for(8)
    assert one is gate.cost_model and eight is gate.cost_model_for(5) is not one
    assert gate.cost_model_for(9) is not eight and gate.cost_model_for(3) is gate.cost_model_for(4)
    step8 = [ChunkShape(1, 100)] * 8
    before = eight.predict(step8)
    for rows in (1, 2, 3, 4, 5, 6):
        gate.observe_cost([ChunkShape(rows, 100)], 2e-3 + 1e-5 * rows)  # rows nearly free alone
    assert eight.predict(step8) == before
    assert one.num_observations == 6 and eight.num_observations == 0
    gate.observe_cost(step8, 9e-3)
    assert eight.num_observations == 1


class _SlowProposer(NgramProposer):
    """Prompt lookup that takes `seconds` a proposal."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def propose(self, request: Request, max_tokens: int) -> Draft:
        time.sleep(self.seconds)
        return super().propose(request, max_tokens)


def test_the_drafter_measures_a_proposals_time() -> None:
    drafter = Drafter(_SlowProposer(0.004), DraftGate(StepCostModel(), 1, enabled=False), 5)
    requests = [make_request(f"r{i}", [1, 2, 3, 1, 2, 3, 1, 2]) for i in range(2)]
    for _ in range(80):
        drafter.plan(requests, 64)
    assert 0.0038 <= drafter.propose_s < 0.02  # the sleep's 4 ms, of 1 - 0.9 ** 80 weight
