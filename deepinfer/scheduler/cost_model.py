"""`StepCostModel`: an online model of prefill step time, fitted from measured steps.

The model (seconds) for one step running prefill chunks (n_i new tokens after ctx_i computed):

    t = step_s + token_s * sum(n_i) + attention_s * sum(n_i * (ctx_i + n_i / 2))
               + kv_token_s * sum(ctx_i + n_i)

`step_s` is the per-step overhead (launches, reading the weights, sampling, synchronisation),
`token_s` the per-token work (matmuls, norms), `attention_s` the per query-key pair work of
causal attention, which grows with the context, and `kv_token_s` the cost of reading a chunk's
whole context from the KV cache once per layer, whatever the chunk's length (memory-bound; a
model without it mistakes small chunks deep in a long prompt for attention work and then plans
ever smaller chunks). Every term is additive across chunks, so a chunk's marginal cost
(`chunk_cost_s`) does not depend on what else runs in the step; only `step_s` is shared.

Fitting: weighted least squares on relative error (each step weighs 1 / measured^2, so short and
long steps count alike), with exponential forgetting (the fit follows a drifting device) and a
constant-weight prior made of pseudo-steps predicted by the prior coefficients (the fit is sane
before any data and stays well-posed when steps all look alike). Coefficients are never negative:
the 4-variable non-negative least squares is solved exactly by trying every active set.
Pure Python: no torch, no numpy (the scheduler layer imports neither).
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from deepinfer.errors import ConfigError

_NUM_FEATURES = 4
_MIN_TIME_S = 1e-9


@dataclass(frozen=True)
class ChunkShape:
    """One prefill chunk as the cost model sees it: `num_new_tokens` after `context_before`."""

    num_new_tokens: int
    context_before: int


PREFILL_PRIOR_SHAPES: tuple[tuple[ChunkShape, ...], ...] = (
    (ChunkShape(16, 0),),
    (ChunkShape(2048, 0),),
    (ChunkShape(1024, 16384),),
    (ChunkShape(16, 16384),),
)
"""Pseudo-steps of a prefill prior: a tiny step (overhead), a wide one (per token), a deep one
(attention), a short deep one (KV reads). Four shapes pin the four coefficients."""
DECODE_PRIOR_SHAPES: tuple[tuple[ChunkShape, ...], ...] = (
    (ChunkShape(1, 0),),
    (ChunkShape(1, 0),) * 32,
    (ChunkShape(1, 4096),),
    (ChunkShape(6, 4096),),
)
"""Pseudo-steps of a decode prior, where decode steps are: one short row (overhead), 32 rows
(per row), one deep row (its attention), a deep row and five drafts. A prior placed where the
data never goes (a 1024-token chunk) would decide the coefficients the data cannot see, and
a decode lane's data does not see prefill's economies of scale."""


@dataclass(frozen=True)
class CostCoefficients:
    step_s: float
    """Fixed overhead of one step, in seconds."""
    token_s: float
    """Seconds per new token."""
    attention_s: float
    """Seconds per (query, key) pair of causal attention."""
    kv_token_s: float = 0.0
    """Seconds per context token a chunk reads from the KV cache (plus its own new ones)."""

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.step_s, self.token_s, self.attention_s, self.kv_token_s)


@dataclass(frozen=True)
class CostModelConfig:
    prior: CostCoefficients = CostCoefficients(
        step_s=2e-3, token_s=5e-5, attention_s=2e-9, kv_token_s=1e-7
    )
    """Coefficients before any data (e.g. from a quick start-up calibration)."""
    prior_weight: float = 0.05
    """Weight of each of the prior's pseudo-steps; one measured step weighs 1 when new."""
    forgetting: float = 0.99
    """Per-observation decay of old steps' weight (effective memory 1 / (1 - forgetting))."""
    error_smoothing: float = 0.1
    """Weight of the newest step in the running mean of relative prediction error."""
    prior_shapes: tuple[tuple[ChunkShape, ...], ...] = PREFILL_PRIOR_SHAPES
    """The steps the prior's pseudo-steps are made of (the prior coefficients predict them):
    shapes like the ones the model will see, which together pin all four coefficients."""

    def __post_init__(self) -> None:
        if min(self.prior.as_tuple()) < 0:
            raise ConfigError(f"cost prior coefficients must be non-negative, got {self.prior}")
        if self.prior.step_s + self.prior.token_s <= 0:
            raise ConfigError("the cost prior must give a step a positive time (step_s or token_s)")
        if self.prior_weight <= 0:
            raise ConfigError(f"cost prior_weight must be positive, got {self.prior_weight}")
        if not 0 < self.forgetting <= 1:
            raise ConfigError(f"cost forgetting must be in (0, 1], got {self.forgetting}")
        if not 0 < self.error_smoothing <= 1:
            raise ConfigError("cost error_smoothing must be in (0, 1]")
        if not _spans_features(self.prior_shapes):
            raise ConfigError("the cost prior's shapes must pin all four coefficients")


@dataclass(frozen=True)
class CostModelStats:
    num_observations: int
    coefficients: CostCoefficients
    mean_abs_rel_error: float
    """Running (exponentially smoothed) |predicted - measured| / measured, each prediction made
    before its step was learned from; NaN before the first observation."""
    last_predicted_s: float
    last_measured_s: float


def features(chunks: Iterable[ChunkShape]) -> tuple[float, float, float, float]:
    """(1, total new tokens, total causal attention pairs, total KV tokens read) of a step."""
    num_tokens = 0.0
    pairs = 0.0
    kv_tokens = 0.0
    for c in chunks:
        num_tokens += c.num_new_tokens
        pairs += c.num_new_tokens * (c.context_before + c.num_new_tokens / 2)
        kv_tokens += c.context_before + c.num_new_tokens
    return (1.0, num_tokens, pairs, kv_tokens)


class StepCostModel:
    """Predicts prefill step time and learns from measured steps.

    Invariants: coefficients are non-negative and finite; the normal matrix is symmetric positive
    definite (the prior keeps it so); `predict(())` is 0 (no step runs).
    """

    def __init__(self, config: CostModelConfig | None = None) -> None:
        self.config = config or CostModelConfig()
        self._gram = [[0.0] * _NUM_FEATURES for _ in range(_NUM_FEATURES)]
        self._rhs = [0.0] * _NUM_FEATURES
        self._prior_gram = [[0.0] * _NUM_FEATURES for _ in range(_NUM_FEATURES)]
        self._prior_rhs = [0.0] * _NUM_FEATURES
        prior = self.config.prior.as_tuple()
        for shape in self.config.prior_shapes:
            x = features(shape)
            y = sum(p * f for p, f in zip(prior, x, strict=True))
            _accumulate(self._prior_gram, self._prior_rhs, x, y, self.config.prior_weight)
        self._coef: tuple[float, float, float, float] = prior
        self.num_observations = 0
        self._mean_rel_error = math.nan
        self._last_predicted_s = math.nan
        self._last_measured_s = math.nan

    @property
    def coefficients(self) -> CostCoefficients:
        return CostCoefficients(*self._coef)

    def predict(self, chunks: Sequence[ChunkShape]) -> float:
        """Predicted seconds for one step running `chunks`; 0 when there are none."""
        if not chunks:
            return 0.0
        return sum(c * f for c, f in zip(self._coef, features(chunks), strict=True))

    @property
    def step_overhead_s(self) -> float:
        return self._coef[0]

    def chunk_cost_s(self, num_new_tokens: int, context_before: int) -> float:
        """Marginal seconds one chunk adds to a step (everything but the step overhead)."""
        if num_new_tokens <= 0:
            return 0.0  # a chunk that does not run reads nothing
        _, b, c, d = self._coef
        n = num_new_tokens
        return b * n + c * n * (context_before + n / 2) + d * (context_before + n)

    def row_cost_s(self, row: int, context_before: int) -> float:
        """Marginal seconds of a chunk's `row`-th new token (1-based), after `context_before`:
        `chunk_cost_s(row, ctx) - chunk_cost_s(row - 1, ctx)` in closed form."""
        if row <= 0:
            return 0.0
        _, b, c, d = self._coef
        first = d * context_before if row == 1 else 0.0  # a chunk reads its context once
        return b + c * (context_before + row - 0.5) + d + first

    def max_tokens_within(
        self, budget_s: float, context_before: int, *, include_overhead: bool = True
    ) -> int:
        """Most new tokens of one request, after `context_before` computed tokens, whose
        predicted cost fits `budget_s` (with the step overhead unless `include_overhead` is
        False, for a chunk joining a step that already pays it). 0 when none fits;
        `sys.maxsize` when tokens are predicted free."""
        _, b, c, d = self._coef
        left = budget_s - (self._coef[0] if include_overhead else 0.0) - d * context_before
        if left <= 0:
            return 0
        # solve (c / 2) n^2 + (b + c * ctx + d) n <= left, in the cancellation-free form
        lin = b + c * context_before + d
        denom = lin + math.sqrt(lin * lin + 2.0 * c * left)
        if denom <= 0:
            return sys.maxsize
        n = 2.0 * left / denom
        if n >= sys.maxsize:
            return sys.maxsize
        n_int = int(n)
        # float rounding may overshoot by one token at the boundary
        while n_int > 0 and self.chunk_cost_s(n_int, context_before) > left:
            n_int -= 1
        return n_int

    def observe(self, chunks: Sequence[ChunkShape], measured_s: float) -> None:
        """Learn from one measured step. Steps without chunks or with a non-positive or
        non-finite time are ignored (nothing to learn from them)."""
        if not chunks or not math.isfinite(measured_s) or measured_s <= 0:
            return
        predicted = self.predict(chunks)
        rel_error = abs(predicted - measured_s) / measured_s
        alpha = self.config.error_smoothing
        if math.isnan(self._mean_rel_error):
            self._mean_rel_error = rel_error
        else:
            self._mean_rel_error += alpha * (rel_error - self._mean_rel_error)
        self._last_predicted_s, self._last_measured_s = predicted, measured_s
        self._decay(self.config.forgetting)
        y = max(measured_s, _MIN_TIME_S)
        _accumulate(self._gram, self._rhs, features(chunks), y, 1.0)
        self.num_observations += 1
        self._refit()

    def stats(self) -> CostModelStats:
        return CostModelStats(
            num_observations=self.num_observations,
            coefficients=self.coefficients,
            mean_abs_rel_error=self._mean_rel_error,
            last_predicted_s=self._last_predicted_s,
            last_measured_s=self._last_measured_s,
        )

    def check_integrity(self) -> None:
        assert all(math.isfinite(c) and c >= 0 for c in self._coef), self._coef
        for i in range(_NUM_FEATURES):
            for j in range(_NUM_FEATURES):
                assert self._gram[i][j] == self._gram[j][i], "normal matrix not symmetric"

    def _decay(self, factor: float) -> None:
        for row in self._gram:
            for j in range(_NUM_FEATURES):
                row[j] *= factor
        for i in range(_NUM_FEATURES):
            self._rhs[i] *= factor

    def _refit(self) -> None:
        gram = [
            [g + p for g, p in zip(gr, pr, strict=True)]
            for gr, pr in zip(self._gram, self._prior_gram, strict=True)
        ]
        rhs = [r + p for r, p in zip(self._rhs, self._prior_rhs, strict=True)]
        coef = _nnls_by_active_sets(gram, rhs, self._coef)
        if coef is not None:
            self._coef = coef


def _accumulate(
    gram: list[list[float]], rhs: list[float], x: Sequence[float], y: float, weight: float
) -> None:
    """Add one step to the normal equations, weighted by relative error (1 / y^2)."""
    w = weight / (y * y)
    for i in range(_NUM_FEATURES):
        rhs[i] += w * x[i] * y
        for j in range(i, _NUM_FEATURES):
            gram[i][j] += w * x[i] * x[j]
            if j != i:
                gram[j][i] = gram[i][j]


def _nnls_by_active_sets(
    gram: list[list[float]], rhs: list[float], guess: Sequence[float] = ()
) -> tuple[float, float, float, float] | None:
    """argmin over theta >= 0 of theta' G theta - 2 r' theta, by trying free subsets.

    With G positive definite the problem is convex; its minimiser is the unconstrained solution
    on some subset of free variables (the others at 0), and a candidate that meets the KKT
    conditions (non-negative, and no zeroed variable whose gradient would have it grow) is it.
    Tried first: every variable free (most fits end there, one solve), then the positive
    variables of `guess` (the last fit: consecutive fits mostly keep their zeros). Only when
    neither is optimal, every subset, feasible candidates compared by objective. None when every
    subset is singular (cannot happen with the prior)."""
    full = _solve(gram, rhs)
    if full is not None and all(v >= 0 for v in full):
        return (full[0], full[1], full[2], full[3])
    if guess:
        free = tuple(i for i, v in enumerate(guess) if v > 0)
        theta = _on_subset(gram, rhs, free)
        if theta is not None and _is_optimal(gram, rhs, theta):
            return theta
    best: tuple[float, tuple[float, float, float, float]] | None = None
    for size in range(_NUM_FEATURES + 1):
        for free in itertools.combinations(range(_NUM_FEATURES), size):
            theta = _on_subset(gram, rhs, free)
            if theta is None:
                continue
            obj = sum(
                theta[i] * gram[i][j] * theta[j]
                for i in range(_NUM_FEATURES)
                for j in range(_NUM_FEATURES)
            ) - 2.0 * sum(r * t for r, t in zip(rhs, theta, strict=True))
            if best is None or obj < best[0]:
                best = (obj, theta)
    return None if best is None else best[1]


def _on_subset(
    gram: list[list[float]], rhs: list[float], free: Sequence[int]
) -> tuple[float, float, float, float] | None:
    """The unconstrained minimiser over the `free` variables, the others 0; None when it is
    singular or has a negative coordinate."""
    sub = _solve([[gram[i][j] for j in free] for i in free], [rhs[i] for i in free])
    if sub is None or any(v < 0 for v in sub):
        return None
    theta = [0.0] * _NUM_FEATURES
    for i, v in zip(free, sub, strict=True):
        theta[i] = v
    return (theta[0], theta[1], theta[2], theta[3])


def _is_optimal(gram: list[list[float]], rhs: list[float], theta: Sequence[float]) -> bool:
    """KKT at a candidate of `_on_subset`: no zeroed variable has a negative gradient (within
    rounding of the terms it sums)."""
    for i in range(_NUM_FEATURES):
        if theta[i] > 0:
            continue
        terms = [gram[i][j] * theta[j] for j in range(_NUM_FEATURES)]
        if sum(terms) - rhs[i] < -1e-9 * (abs(rhs[i]) + sum(abs(t) for t in terms)):
            return False
    return True


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve a x = b (a small SPD matrix) by Jacobi-scaled Gaussian elimination; None if
    singular. Scaling matters: features span ~1 to ~1e9."""
    n = len(b)
    if n == 0:
        return []
    scale = [1.0 / math.sqrt(a[i][i]) if a[i][i] > 0 else 0.0 for i in range(n)]
    if 0.0 in scale:
        return None
    m = [[a[i][j] * scale[i] * scale[j] for j in range(n)] + [b[i] * scale[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    return [m[i][n] / m[i][i] * scale[i] for i in range(n)]


def _spans_features(shapes: Sequence[Sequence[ChunkShape]]) -> bool:
    """Whether the steps' feature vectors span all four dimensions (their Gram matrix is
    nonsingular, so the prior alone determines every coefficient)."""
    gram = [[0.0] * _NUM_FEATURES for _ in range(_NUM_FEATURES)]
    rhs = [0.0] * _NUM_FEATURES
    for shape in shapes:
        if not shape:
            return False
        _accumulate(gram, rhs, features(shape), 1.0, 1.0)
    return _solve(gram, [1.0] * _NUM_FEATURES) is not None
