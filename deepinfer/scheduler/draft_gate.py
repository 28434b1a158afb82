"""The confidence gate of speculative decoding: how many of each request's drafts a step verifies.

For each request and draft position j, an estimate of the chance that the draft is accepted
given that the ones before it were: a logistic model per proposer (`AcceptanceModel`) over

- the request's own recent acceptance rate (each verification weighs 0.9 of the next one),
  pulled toward the proposer's rate over all requests by two pseudo-trials (as a logit: a new
  request starts from the proposer's rate),
- the position in the draft (-0.5 for the first draft, 0.5 for the last a step may verify),
- the proposer's own signals for the draft (`Draft.signals`, each in [0, 1], centred: for
  prompt lookup, the length of the n-gram that matched).

Its weights start at the prior "the request's rate is the answer" (1 on the rate's logit, 0
elsewhere, worth ten observations on the bias and the rate's weight and one on the slopes: the
prior decides while observations are few) and are fitted online, one Bayesian (Laplace) update
per observed position: the accepted ones and the first rejected one of each verified draft
(later positions were never put to the test), older observations fading over about 4,096.
`calibration()` keeps predicted against observed acceptance by bucket of prediction
(`/metrics`). A request whose drafts the gate turned down for `EXPLORE_EVERY` steps times the
number of decoders verifies one anyway, so that a request that starts badly is seen when its
drafts get better, at the cost of about one row in 16 steps whatever the batch; a look that
fails doubles the request's wait for the next one (up to `MAX_BACKOFF` times).

A position j of acceptance q_j (the product of the conditional estimates up to j) costs the
extra query row it adds to its request's chunk (a decode `StepCostModel`, one per power-of-two
range of batch sizes: `cost_model_for`). Positions
are added best first while the tokens the step is expected to produce per second of predicted
step time grows by a margin: a position is worth it when q_j / dc_j exceeds the step's current
tokens / cost times `GAIN_MARGIN`. A step's cost is its forward pass (the cost model's) plus
`loop_s`, the time the decode loop spends around it (the drafter measures it): alone, a fifth
to a third of a step on CPU, and saved, as the forward's weight reads are, by every step that
drafts save.
`enabled=False` verifies every draft (the baseline), still learning and keeping calibration.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.request import Request
from deepinfer.scheduler.cost_model import ChunkShape, StepCostModel

NUM_CALIBRATION_BUCKETS = 10
LONG_DRAFT_TOKENS = 15
"""Most drafts a request verifies from a proposer that sizes its own (suffix decoding, a
prediction): with its last token, 16 rows, two passes of the CPU's int8 kernel (8 rows a pass
with VNNI, 4 without); a 17th row starts a third pass that costs as much as two rows (the 1.5B
Qwen2.5-Coder's decode step on the Zen 5 EPYC: 8 rows 57 ms, 9 rows 66 ms; 16 rows 88 ms, 17
rows 98 ms). The gate still cuts them to what pays."""
EXPLORE_EVERY = 16
"""A request whose drafts went unverified this many steps times the number of decoders
verifies its next first draft anyway: without a look now and then, a request whose drafts
failed early would never be seen to do better. About one row in 16 steps in all, whatever the
batch (alone, 1.5% of a step's time on two cores)."""
GAIN_MARGIN = 1.15
"""A position is verified only if its expected tokens per predicted second beat the step's by
this factor. At break-even a draft adds no throughput but does add the loop's work for the
tokens it brings and the risk of a wrong prediction: with 32 streams on two cores, verifying
every position down to break-even produced the same tokens per second of step as plain
decoding (measured: 0.626 against 0.619 tokens/ms). Alone, where a draft costs a sixth of a
step, the margin moves the cut from an acceptance of 0.17 to 0.19."""
MAX_BACKOFF = 8
"""A request whose verified drafts all fail waits twice as long for its next look, up to this
many times `EXPLORE_EVERY` (a look is not always one cheap row: a draft model computes the
tokens it missed since the last one first)."""


@dataclass(frozen=True)
class Draft:
    """A proposer's draft for one request: the tokens, and its confidence signals (each in
    [0, 1], the same number for every draft of a proposer; see the proposer). A proposer that
    drafts on the worker (a model) gives no tokens but how many it may draft there
    (`num_worker_tokens`): the step reserves their slots and the runner fills them in."""

    token_ids: tuple[int, ...] = ()
    signals: tuple[float, ...] = ()
    num_worker_tokens: int = 0

    @property
    def size(self) -> int:
        return len(self.token_ids) or self.num_worker_tokens

    def cut(self, n: int) -> Draft:
        """The first `n` positions."""
        if self.num_worker_tokens:
            return Draft(signals=self.signals, num_worker_tokens=min(n, self.num_worker_tokens))
        return Draft(self.token_ids[:n], self.signals)


@dataclass(frozen=True)
class CalibrationBucket:
    """Observed positions whose predicted acceptance fell in [lower, lower + 0.1)."""

    lower: float
    num_trials: int
    predicted: float
    """Sum of the predictions (mean: predicted / num_trials)."""
    accepted: int


class AcceptanceModel:
    """Logistic regression of a draft position's acceptance, fitted online (module docstring):
    a Gaussian belief over the weights (mean `weights`, covariance `_cov`), updated by one
    Laplace step per observation (the extended Kalman filter's way: O(d^2), pure Python), its
    covariance inflated by 1 / `forget` each time so old observations fade (a window of about
    `window` of them)."""

    def __init__(
        self,
        num_signals: int,
        window: int = 4096,
        prior_strength: tuple[float, float] = (10.0, 1.0),
    ) -> None:
        self.num_signals = num_signals
        self.prior = (0.0, 1.0, 0.0, *([0.0] * num_signals))
        """Weights of (bias, logit of the request's rate, position, *signals)."""
        self.weights = list(self.prior)
        pull = [prior_strength[0]] * 2 + [prior_strength[1]] * (1 + num_signals)
        """The prior's precision, in observations' worth: strong on the bias and the rate's
        weight (the first few observations already moved the rate: letting them move the bias
        as much would count them twice), light on the slopes."""
        n = len(self.prior)
        self._cov = [[(1.0 / pull[i] if i == j else 0.0) for j in range(n)] for i in range(n)]
        self.forget = 1.0 - 1.0 / window
        self.num_updates = 0
        self._trials = [0] * NUM_CALIBRATION_BUCKETS
        self._predicted = [0.0] * NUM_CALIBRATION_BUCKETS
        self._accepted = [0] * NUM_CALIBRATION_BUCKETS

    def predict(self, x: Sequence[float]) -> float:
        z = sum(w * v for w, v in zip(self.weights, x, strict=True))
        return 1.0 / (1.0 + math.exp(-max(-30.0, min(30.0, z))))

    def update(self, x: Sequence[float], accepted: bool, predicted: float) -> None:
        """An observed position: its features, outcome, and the prediction the step used (for
        the calibration buckets; the fit uses the current weights')."""
        bucket = min(int(predicted * NUM_CALIBRATION_BUCKETS), NUM_CALIBRATION_BUCKETS - 1)
        self._trials[bucket] += 1
        self._predicted[bucket] += predicted
        self._accepted[bucket] += int(accepted)
        self.num_updates += 1
        p = self.predict(x)
        cov, n = self._cov, len(x)
        # covariance inflated (forgetting), then the rank-one Laplace update of one observation
        cx = [sum(cov[i][j] * x[j] for j in range(n)) / self.forget for i in range(n)]
        curvature = max(p * (1.0 - p), 1e-6)
        denom = 1.0 / curvature + sum(x[i] * cx[i] for i in range(n))
        for i in range(n):
            row = cov[i]
            for j in range(n):
                row[j] = row[j] / self.forget - cx[i] * cx[j] / denom
        error = float(accepted) - p
        gain = [sum(cov[i][j] * x[j] for j in range(n)) for i in range(n)]
        self.weights = [w + g * error for w, g in zip(self.weights, gain, strict=True)]

    def calibration(self) -> tuple[CalibrationBucket, ...]:
        return tuple(
            CalibrationBucket(b / NUM_CALIBRATION_BUCKETS, n, p, a)
            for b, (n, p, a) in enumerate(
                zip(self._trials, self._predicted, self._accepted, strict=True)
            )
        )


@dataclass
class _Rate:
    accepted: float = 0.0
    trials: float = 0.0


class _Positions:
    """One request's draft positions as the gate sees them, computed as far as asked: each
    position's features and conditional acceptance, and their running product."""

    def __init__(self, gate: DraftGate, request_id: str, draft: Draft) -> None:
        self._gate, self._request_id, self._signals = gate, request_id, draft.signals
        self._step = 1.0 / max(gate.max_drafts - 1, 1)
        self._first: list[float] = []
        """Position 0's features, made at the first ask (a request without drafts: never)."""
        self._seen: list[tuple[list[float], float]] = []
        self._survival: list[float] = []

    def survival(self, j: int) -> float:
        """The chance that positions 0..j are all accepted."""
        if not self._first:
            self._first = self._gate.features(self._request_id, 0, self._signals)
        while len(self._survival) <= j:
            x = list(self._first)
            x[2] += len(self._seen) * self._step
            p = self._gate.model.predict(x)
            self._seen.append((x, p))
            self._survival.append(p * (self._survival[-1] if self._survival else 1.0))
        return self._survival[j]

    def observed(self, k: int) -> list[tuple[list[float], float]]:
        """The first `k` positions' features and conditional predictions (`DraftGate.observe`)."""
        self.survival(k - 1)
        return self._seen[:k]


def _logit(p: float) -> float:
    p = min(max(p, 0.02), 0.98)
    return math.log(p / (1.0 - p))


class DraftGate:
    """See the module docstring."""

    def __init__(
        self,
        cost_model: StepCostModel,
        num_signals: int = 0,
        max_drafts: int = 5,
        enabled: bool = True,
        prior_rate: float = 0.5,
        prior_strength: float = 2.0,
        recency: float = 0.9,
    ) -> None:
        self.cost_model = cost_model
        """The cost model of steps of one decoder; `cost_model_for` gives each batch size's."""
        self._costs: dict[int, StepCostModel] = {0: cost_model}
        self.model = AcceptanceModel(num_signals)
        self.max_drafts = max_drafts
        self.enabled = enabled
        self.prior_rate, self.prior_strength = prior_rate, prior_strength
        self.recency = recency
        """A request's past verifications count this much less at each new one: what it
        does now (quoting a file, or chatting) says more than what it did."""
        self._global = _Rate()
        self._rates: dict[str, _Rate] = {}
        self._chosen: dict[str, list[tuple[list[float], float]]] = {}
        """Each request's positions its latest step verifies: features and prediction."""
        self._idle: dict[str, int] = {}
        """Steps since each request last verified a draft (`EXPLORE_EVERY`)."""
        self._explore_after = EXPLORE_EVERY
        self._backoff: dict[str, int] = {}
        """How many times `_explore_after` each request waits for its next look."""
        self.loop_s = 0.0
        """Seconds a decode step costs outside its forward pass (`drafting.LoopOverhead`)."""

    def rate(self, request_id: str) -> float:
        """The request's observed rate of acceptance, pulled toward the proposer's."""
        g, k = self._global, self.prior_strength
        base = (g.accepted + k * self.prior_rate) / (g.trials + k)
        own = self._rates.get(request_id, _Rate())
        return (own.accepted + k * base) / (own.trials + k)

    def features(self, request_id: str, position: int, signals: Sequence[float]) -> list[float]:
        """(1, logit of the rate, position, *signals), the last ones centred on 0 (so the prior
        weights, 0 on them, leave the rate alone and the pull keeps the bias where it is)."""
        where = position / max(self.max_drafts - 1, 1)
        return [1.0, _logit(self.rate(request_id)), where - 0.5, *(v - 0.5 for v in signals)]

    def acceptance(self, request_id: str, draft: Draft) -> list[float]:
        """The chance that each draft position is accepted (the product up to it)."""
        positions = _Positions(self, request_id, draft)
        return [positions.survival(j) for j in range(draft.size)]

    def cost_model_for(self, num_requests: int) -> StepCostModel:
        """The cost model of steps of `num_requests` decoders: one per power-of-two range (1, 2,
        3-4, 5-8, ...), each fitted on its own steps from the same prior. A row's cost is not
        linear in the rows: the first few share one read of the weights, past that each pays its
        arithmetic (the int8 matmuls take 8 rows a pass with VNNI, 4 without), so one linear fit
        over every batch size prices drafts for the batch sizes it saw last (alone: rows look
        nearly free, and the first seconds at 8 streams then verified drafts that did not pay)."""
        bucket = max(num_requests - 1, 0).bit_length()
        model = self._costs.get(bucket)
        if model is None:
            model = self._costs[bucket] = StepCostModel(self.cost_model.config)
        return model

    def observe_cost(self, chunks: Sequence[ChunkShape], seconds: float) -> None:
        """A measured decode step (one chunk a decoder) for its batch size's cost model."""
        self.cost_model_for(len(chunks)).observe(chunks, seconds)

    def worth_proposing(self, requests: Sequence[Request], propose_s: float = 0.0) -> list[bool]:
        """Whether a first draft of each request could pay in a step of all of them, with the
        most favourable signals (if not, the proposer is not even asked); `propose_s`: what
        asking the proposer costs, counted with the draft's row."""
        if not self.enabled:
            return [True] * len(requests)
        costs = self.cost_model_for(len(requests))
        per_second = len(requests) / self._plain_step_s(requests, costs)
        best = [1.0 if w > 0 else 0.0 for w in self.model.weights[3:]]
        worth = []
        self._explore_after = EXPLORE_EVERY * len(requests)
        bar = per_second * GAIN_MARGIN
        for r in requests:
            idle = self._idle[r.request_id] = self._idle.get(r.request_id, 0) + 1
            q = self.model.predict(self.features(r.request_id, 0, best))
            cost = self._draft_s(r, 0, costs) + propose_s
            worth.append(self._looks(r.request_id, idle) or q / cost > bar)
        return worth

    def _plain_step_s(self, requests: Sequence[Request], costs: StepCostModel) -> float:
        """Predicted seconds of a step of `requests` without drafts, the loop's included."""
        chunks = [ChunkShape(1, r.num_computed_tokens) for r in requests]
        return max(costs.predict(chunks) + self.loop_s, 1e-9)

    def _draft_s(self, request: Request, j: int, costs: StepCostModel) -> float:
        """Predicted seconds that a request's (j + 1)-th draft adds to its chunk."""
        return max(costs.row_cost_s(j + 2, request.num_computed_tokens), 1e-12)

    def choose(self, candidates: Sequence[tuple[Request, Draft]]) -> list[int]:
        """For each (request, draft), how many drafts to verify. Every request of the step is
        listed (those without drafts with an empty one): the step's cost depends on all."""
        positions = [_Positions(self, r.request_id, d) for r, d in candidates]
        if self.enabled:
            chosen = self._choose(candidates, positions)
        else:
            chosen = [d.size for _, d in candidates]
        for (r, _), at, k in zip(candidates, positions, chosen, strict=True):
            if k > 0:
                self._chosen[r.request_id] = at.observed(k)
                self._idle[r.request_id] = 0
            else:
                self._chosen.pop(r.request_id, None)
        return chosen

    def _choose(
        self, candidates: Sequence[tuple[Request, Draft]], positions: Sequence[_Positions]
    ) -> list[int]:
        tokens = float(len(candidates))
        costs = self.cost_model_for(len(candidates))
        seconds = self._plain_step_s([r for r, _ in candidates], costs)
        chosen = [0] * len(candidates)

        def option(i: int) -> tuple[float, float, float, int]:
            """(-gain, expected tokens, seconds) of request i's next position."""
            extra = self._draft_s(candidates[i][0], chosen[i], costs)
            q = positions[i].survival(chosen[i])
            return (-q / extra, q, extra, i)

        heap = [option(i) for i, (_, d) in enumerate(candidates) if d.size]
        heapq.heapify(heap)
        while heap:
            neg_gain, q, extra, i = heapq.heappop(heap)
            if -neg_gain <= tokens / seconds * GAIN_MARGIN:
                break  # the best position left would not raise tokens per second enough
            tokens, seconds = tokens + q, seconds + extra
            chosen[i] += 1
            if chosen[i] < candidates[i][1].size:
                heapq.heappush(heap, option(i))
        for i, (r, d) in enumerate(candidates):
            idle = self._idle.get(r.request_id, 0)
            if d.size and not chosen[i] and self._looks(r.request_id, idle):
                chosen[i] = 1  # a look now and then: a request's drafts may have got better
        return chosen

    def _looks(self, request_id: str, idle: int) -> bool:
        """Whether a request turned down for `idle` steps verifies a draft anyway."""
        return idle >= self._explore_after * self._backoff.get(request_id, 1)

    def observe(self, request_id: str, verified: int, accepted: int) -> None:
        """A step verified `verified` drafts of a request and the model agreed with the first
        `accepted`: the positions tried are the accepted ones and the first rejected one."""
        features = self._chosen.pop(request_id, [])
        if verified <= 0:
            return
        trials = accepted + (1 if accepted < verified else 0)
        for j, (x, predicted) in enumerate(features[:trials]):
            self.model.update(x, j < accepted, predicted)
        if accepted:
            self._backoff.pop(request_id, None)
        else:
            wait = self._backoff.get(request_id, 1)
            self._backoff[request_id] = min(2 * wait, MAX_BACKOFF)
        self._global.accepted += accepted
        self._global.trials += trials
        own = self._rates.setdefault(request_id, _Rate())
        own.accepted = own.accepted * self.recency + accepted
        own.trials = own.trials * self.recency + trials

    def forget(self, request_id: str) -> None:
        self._rates.pop(request_id, None)
        self._chosen.pop(request_id, None)
        self._idle.pop(request_id, None)
        self._backoff.pop(request_id, None)
