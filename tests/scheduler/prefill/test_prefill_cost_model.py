"""`StepCostModel`: prior, budget solving, non-negative fit, convergence on synthetic steps."""

from __future__ import annotations

import math
import random

import pytest

from deepinfer.errors import ConfigError
from deepinfer.scheduler.cost_model import (
    DECODE_PRIOR_SHAPES,
    ChunkShape,
    CostCoefficients,
    CostModelConfig,
    StepCostModel,
    _nnls_by_active_sets,
    features,
)
from tests.scheduler.prefill.prefill_fakes import GroundTruth

PRIOR = CostCoefficients(step_s=2e-3, token_s=5e-5, attention_s=2e-9)


def _random_step(rng: random.Random) -> list[ChunkShape]:
    return [
        ChunkShape(rng.randint(1, 4096), rng.choice([0, rng.randint(0, 60000)]))
        for _ in range(rng.randint(1, 4))
    ]


def test_prior_predicts_before_any_data() -> None:
    model = StepCostModel(CostModelConfig(prior=PRIOR))
    step = [ChunkShape(100, 0), ChunkShape(50, 1000)]
    expected = 2e-3 + 5e-5 * 150 + 2e-9 * (100 * 50 + 50 * (1000 + 25))
    assert model.predict(step) == pytest.approx(expected, rel=1e-12)
    assert model.predict([]) == 0.0
    assert math.isnan(model.stats().mean_abs_rel_error)


def test_features_count_tokens_and_attention_pairs() -> None:
    assert features([ChunkShape(10, 0), ChunkShape(4, 6)]) == (1.0, 14.0, 10 * 5 + 4 * 8, 10 + 10)


@pytest.mark.parametrize("context_before", [0, 100, 30000, 500000])
@pytest.mark.parametrize("budget_s", [1e-4, 2.5e-3, 0.05, 1.0])
@pytest.mark.parametrize("include_overhead", [True, False])
def test_max_tokens_within_is_the_largest_fit(
    context_before: int, budget_s: float, include_overhead: bool
) -> None:
    model = StepCostModel(CostModelConfig(prior=PRIOR))
    n = model.max_tokens_within(budget_s, context_before, include_overhead=include_overhead)

    def cost(k: int) -> float:
        chunk = model.chunk_cost_s(k, context_before)
        return chunk + (model.step_overhead_s if include_overhead else 0.0)

    assert n >= 0
    if n > 0:
        assert cost(n) <= budget_s
        assert model.predict([ChunkShape(n, context_before)]) == pytest.approx(
            cost(n) + (0.0 if include_overhead else model.step_overhead_s)
        )
    assert cost(n + 1) > budget_s


def test_budget_below_overhead_fits_nothing() -> None:
    model = StepCostModel(CostModelConfig(prior=PRIOR))
    assert model.max_tokens_within(1e-3, 0) == 0
    assert model.max_tokens_within(1e-3, 0, include_overhead=False) > 0


@pytest.mark.parametrize("seed", range(20))
def test_nnls_matches_scipy(seed: int) -> None:
    import numpy as np  # the scheduler never imports numpy: only this reference test does
    from scipy import optimize  # in the `test` extra: a missing scipy fails, never skips

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(12, 4))
    y = rng.normal(size=12)
    gram, rhs = (x.T @ x).tolist(), (x.T @ y).tolist()
    ours = _nnls_by_active_sets(gram, rhs)
    assert ours is not None
    ref, _ = optimize.nnls(x, y)
    assert ours == pytest.approx(ref.tolist(), abs=1e-9)
    # a warm start from any support (right, wrong, all zero) reaches the same minimum
    for guess in (ours, [1.0, 0.0, 1.0, 0.0], [0.0] * 4, [1.0] * 4):
        warm = _nnls_by_active_sets(gram, rhs, guess)
        assert warm == pytest.approx(ref.tolist(), abs=1e-9)


def test_converges_on_synthetic_steps(record_property: object) -> None:
    truth = GroundTruth(step_s=4e-3, token_s=3e-5, attention_s=1.5e-9, noise=0.05, seed=1)
    model = StepCostModel(CostModelConfig(prior=PRIOR))
    rng = random.Random(1)
    errors = []
    for _ in range(400):
        step = _random_step(rng)
        measured = truth.measure_s(step)
        errors.append(abs(model.predict(step) - measured) / measured)
        model.observe(step, measured)
        model.check_integrity()
    # noise-free error of the fitted model on fresh steps: what is left is model error
    fresh = [_random_step(rng) for _ in range(200)]
    fit_error = sum(abs(model.predict(s) / truth.exact_s(s) - 1) for s in fresh) / len(fresh)
    early, late = sum(errors[:20]) / 20, sum(errors[-100:]) / 100
    coef = model.coefficients
    print(
        f"\ncost model: prediction error first 20 steps {early:.1%}, last 100 {late:.1%}, "
        f"vs noise-free truth {fit_error:.2%}; fitted {coef}"
    )
    record_property("prediction_error_last_100", late)  # type: ignore[operator]
    assert late < 0.10
    assert fit_error < 0.03
    assert model.stats().mean_abs_rel_error < 0.10
    assert coef.token_s == pytest.approx(truth.token_s, rel=0.15)
    assert coef.attention_s == pytest.approx(truth.attention_s, rel=0.15)


def test_follows_a_device_that_slows_down() -> None:
    """Forgetting: after the device turns 2x slower, predictions recover."""
    model = StepCostModel(CostModelConfig(prior=PRIOR, forgetting=0.97))
    fast = GroundTruth(noise=0.02, seed=2)
    slow = GroundTruth(step_s=8e-3, token_s=6e-5, attention_s=3e-9, noise=0.02, seed=3)
    rng = random.Random(2)
    for _ in range(200):
        step = _random_step(rng)
        model.observe(step, fast.measure_s(step))
    errors = []
    for _ in range(200):
        step = _random_step(rng)
        measured = slow.measure_s(step)
        errors.append(abs(model.predict(step) - measured) / measured)
        model.observe(step, measured)
    assert sum(errors[:5]) / 5 > 0.3
    assert sum(errors[-50:]) / 50 < 0.05


def test_coefficients_stay_non_negative() -> None:
    """Data that a plain least-squares fit would explain with a negative intercept."""
    model = StepCostModel(CostModelConfig(prior=PRIOR, prior_weight=1e-3))
    rng = random.Random(4)
    for _ in range(100):
        n = rng.randint(100, 4000)
        model.observe([ChunkShape(n, 0)], max(1e-5 * n - 5e-3, 1e-6))
        model.check_integrity()
    assert min(model.coefficients.as_tuple()) >= 0.0


def test_bad_measurements_are_ignored() -> None:
    model = StepCostModel(CostModelConfig(prior=PRIOR))
    for bad in (0.0, -1.0, math.nan, math.inf):
        model.observe([ChunkShape(10, 0)], bad)
    model.observe([], 1.0)
    assert model.num_observations == 0
    assert model.coefficients == PRIOR


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prior": CostCoefficients(-1.0, 1e-5, 0.0)},
        {"prior": CostCoefficients(0.0, 0.0, 1e-9)},
        {"prior_weight": 0.0},
        {"forgetting": 0.0},
        {"forgetting": 1.5},
        {"error_smoothing": 0.0},
        {"prior_shapes": ((ChunkShape(1, 0),), (ChunkShape(1, 100),), (ChunkShape(1, 200),))},
        {"prior_shapes": ((ChunkShape(1, 0),),) * 4},
        {"prior_shapes": ((),) * 4},
    ],
)
def test_config_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        CostModelConfig(**kwargs)


@pytest.mark.parametrize("context_before", [0, 17, 640])
def test_row_cost_is_the_difference_of_chunk_costs(context_before: int) -> None:
    """A chunk's n-th token costs what a chunk of n costs over one of n - 1 (the gate prices a
    draft with it)."""
    model = StepCostModel()
    for i in range(12):
        model.observe([ChunkShape(1 + i % 5, 90 * i)], 0.004 + 0.0007 * i)
    for row in range(1, 8):
        step = model.chunk_cost_s(row, context_before) - model.chunk_cost_s(row - 1, context_before)
        assert model.row_cost_s(row, context_before) == pytest.approx(step, rel=1e-12)
    assert model.row_cost_s(0, context_before) == 0.0


def test_decode_prior_learns_what_decode_steps_show() -> None:
    """A decode lane's prior is made of decode-like steps: fitted to steps of 1 to 40 rows, the
    per-row and per-key costs are the steps' own, where a prefill prior (a 1024-token chunk at
    16k keys) would hold the per-key cost near its own guess: nothing in decode steps contests it."""
    truth = CostCoefficients(step_s=3e-3, token_s=8e-4, attention_s=7e-7)
    rng = random.Random(5)
    fitted = {}
    for name, shapes in (("decode", DECODE_PRIOR_SHAPES), ("prefill", None)):
        prior = CostCoefficients(step_s=8e-3, token_s=1.5e-3, attention_s=1e-9, kv_token_s=4e-6)
        config = CostModelConfig(prior=prior, prior_weight=0.5)
        if shapes is not None:
            config = CostModelConfig(prior=prior, prior_weight=0.5, prior_shapes=shapes)
        model = StepCostModel(config)
        for _ in range(300):
            step = [
                ChunkShape(rng.randint(1, 6), rng.randint(200, 1200))
                for _ in range(rng.randint(1, 8))
            ]
            model.observe(
                step, sum(c * f for c, f in zip(truth.as_tuple(), features(step), strict=True))
            )
        fitted[name] = model.coefficients
    assert fitted["decode"].attention_s == pytest.approx(7e-7, rel=0.1)
    assert fitted["decode"].token_s == pytest.approx(8e-4, rel=0.1)
    assert fitted["prefill"].attention_s < 3.5e-7
