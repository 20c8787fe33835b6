"""The largest-fit search against synthetic oracles whose limit is known exactly."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from lightning_gpuopt.core.search import predicted_largest_fit, round_down, search_largest_fit


def linear_oracle(fixed: int, per_sample: int, cap: int):
    calls = []

    def fits(batch_size: int):
        calls.append(batch_size)
        peak = fixed + per_sample * batch_size
        return peak <= cap, peak

    fits.calls = calls  # type: ignore[attr-defined]
    return fits


def true_limit(fixed: int, per_sample: int, cap: int, multiple_of: int = 1, upper: int = 10**9) -> int:
    return min(round_down((cap - fixed) // per_sample, multiple_of), round_down(upper, multiple_of))


def check(result, fits, limit: int, lo: int, hi: int, multiple_of: int) -> None:
    assert result.batch_size == limit
    assert [t.batch_size for t in result.trials] == fits.calls  # every trial is a real call, in order
    chosen = [t for t in result.trials if t.batch_size == result.batch_size]
    assert chosen and all(t.fits for t in chosen)  # the answer was tested and fitted
    for trial in result.trials:
        assert trial.batch_size % multiple_of == 0 and lo <= trial.batch_size <= hi
        assert trial.fits == (trial.batch_size <= limit)
    if result.stop_reason == "bracketed":
        assert any(not t.fits and t.batch_size == limit + multiple_of for t in result.trials)


@pytest.mark.parametrize("start_error", [1.0, 0.7, 1.3, 3.0, 0.05])
def test_limit_near_1000_found_in_at_most_8_trials_from_an_imperfect_estimate(start_error):
    fixed, per_sample, cap = 3_000_000, 10_000, 13_000_000  # limit 1000
    fits = linear_oracle(fixed, per_sample, cap)
    result = search_largest_fit(fits, budget_bytes=cap, start=int(1000 * start_error), max_batch_size=8192)
    check(result, fits, 1000, 1, 8192, 1)
    assert len(result.trials) <= 8
    assert result.stop_reason == "bracketed"


@pytest.mark.parametrize("slope_error", [0.2, 1.0, 5.0])
def test_a_wrong_estimated_slope_costs_trials_but_not_correctness(slope_error):
    fixed, per_sample, cap = 3_000_000, 10_000, 13_000_000
    fits = linear_oracle(fixed, per_sample, cap)
    result = search_largest_fit(
        fits, budget_bytes=cap, start=900, max_batch_size=8192, bytes_per_sample=per_sample * slope_error
    )
    check(result, fits, 1000, 1, 8192, 1)
    assert len(result.trials) <= 8


def test_without_an_estimate_it_grows_at_most_4x_a_trial():
    fits = linear_oracle(3_000_000, 10_000, 13_000_000)
    result = search_largest_fit(fits, budget_bytes=13_000_000, start=2, max_batch_size=8192)
    check(result, fits, 1000, 1, 8192, 1)
    sizes = [t.batch_size for t in result.trials]
    assert all(b <= 4 * a for a, b in itertools.pairwise(sizes))
    assert len(result.trials) <= 8


@pytest.mark.parametrize("multiple_of", [8, 64])
def test_sizes_are_multiples_and_the_next_multiple_is_proven_not_to_fit(multiple_of):
    fits = linear_oracle(3_000_000, 10_000, 13_000_000)
    result = search_largest_fit(fits, budget_bytes=13_000_000, start=700, max_batch_size=8192, multiple_of=multiple_of)
    check(result, fits, true_limit(3_000_000, 10_000, 13_000_000, multiple_of), multiple_of, 8192, multiple_of)


def test_convex_piecewise_linear_peak_is_still_found_exactly():
    # small batches: the optimizer step sets the peak (flat); large ones: activations (steep)
    def fits(batch_size: int):
        peak = max(8_000_000, 2_000_000 + 12_000 * batch_size)
        fits.calls.append(batch_size)
        return peak <= 14_000_000, peak

    fits.calls = []  # type: ignore[attr-defined]
    result = search_largest_fit(fits, budget_bytes=14_000_000, start=50, max_batch_size=8192)
    check(result, fits, 1000, 1, 8192, 1)
    assert len(result.trials) <= 10  # from 20x below the limit with a flat line at first


def test_a_nonlinear_peak_converges_by_bisection():
    def fits(batch_size: int):
        peak = 1_000 * batch_size + batch_size**2 * 3  # superlinear: the line always over-predicts
        fits.calls.append(batch_size)
        return peak <= 4_000_000, peak

    fits.calls = []  # type: ignore[attr-defined]
    limit = max(b for b in range(1, 5000) if 1_000 * b + 3 * b * b <= 4_000_000)
    result = search_largest_fit(fits, budget_bytes=4_000_000, start=100, max_batch_size=8192, max_trials=20)
    check(result, fits, limit, 1, 8192, 1)


def test_random_linear_budgets_always_exact_and_within_8_trials():
    rng = random.Random(0)
    for _ in range(300):
        per_sample = rng.randint(100, 100_000)
        fixed = rng.randint(0, 50_000_000)
        limit = rng.randint(1, 5000)
        cap = fixed + per_sample * limit + rng.randint(0, per_sample - 1)
        multiple_of = rng.choice([1, 1, 2, 8])
        upper = rng.choice([8192, 10**6])
        expected = true_limit(fixed, per_sample, cap, multiple_of, upper)
        if expected < multiple_of:
            continue
        fits = linear_oracle(fixed, per_sample, cap)
        start = max(1, int(limit * rng.uniform(0.05, 4.0)))
        result = search_largest_fit(fits, budget_bytes=cap, start=start, max_batch_size=upper, multiple_of=multiple_of)
        check(result, fits, expected, multiple_of, round_down(upper, multiple_of), multiple_of)
        assert len(result.trials) <= 8, (fixed, per_sample, cap, start, multiple_of, result.trials)


def test_a_tolerance_stops_within_it_of_the_limit_in_no_more_trials():
    # limit 1000: with tolerance 1/64 the search may stop once the smallest miss is within 1/64 of the largest fit
    rng = random.Random(1)
    stopped_early = 0
    for _ in range(300):
        per_sample, fixed, limit = rng.randint(100, 100_000), rng.randint(0, 50_000_000), rng.randint(64, 5000)
        cap = fixed + per_sample * limit + rng.randint(0, per_sample - 1)
        start = max(1, int(limit * rng.uniform(0.05, 4.0)))
        exact = search_largest_fit(
            linear_oracle(fixed, per_sample, cap), budget_bytes=cap, start=start, max_batch_size=8192
        )
        fits = linear_oracle(fixed, per_sample, cap)
        result = search_largest_fit(fits, budget_bytes=cap, start=start, max_batch_size=8192, tolerance=1 / 64)
        assert [t.batch_size for t in result.trials] == fits.calls
        assert all(t.fits == (t.batch_size <= limit) for t in result.trials)
        assert limit / (1 + 1 / 64) <= result.batch_size <= limit and len(result.trials) <= len(exact.trials)
        if result.stop_reason == "within tolerance":
            miss = min(t.batch_size for t in result.trials if not t.fits)
            assert 1 < miss - result.batch_size <= result.batch_size / 64
            stopped_early += 1
        else:
            assert result.stop_reason == "bracketed" and result.batch_size == limit
    assert stopped_early > 0  # the rule is exercised, not only the exact stop


def test_a_tolerance_saves_the_last_bisections_where_the_line_misleads():
    def fits(batch_size: int):
        peak = 1_000 * batch_size + batch_size**2 * 3  # superlinear: the line always over-predicts
        fits.calls.append(batch_size)
        return peak <= 5_000_000, peak

    limit = max(b for b in range(1, 5000) if 1_000 * b + 3 * b * b <= 5_000_000)  # 1135
    search = dict(budget_bytes=5_000_000, start=100, max_batch_size=8192, max_trials=20)
    fits.calls = []  # type: ignore[attr-defined]
    exact = search_largest_fit(fits, **search)
    fits.calls = []  # type: ignore[attr-defined]
    result = search_largest_fit(fits, **search, tolerance=1 / 64)
    miss = min(t.batch_size for t in result.trials if not t.fits)
    assert exact.batch_size == limit and limit / (1 + 1 / 64) <= result.batch_size <= limit
    assert result.stop_reason == "within tolerance" and miss - result.batch_size <= result.batch_size / 64
    assert len(result.trials) < len(exact.trials), ([t.batch_size for t in exact.trials], fits.calls)


def test_a_tolerance_below_one_size_is_the_exact_search():
    # best / 64 < multiple_of: the stop is the exact one (limit 50, a size a sample)
    fits = linear_oracle(3_000_000, 10_000, 3_500_000)
    result = search_largest_fit(fits, budget_bytes=3_500_000, start=70, max_batch_size=8192, tolerance=1 / 64)
    assert result.batch_size == 50 and result.stop_reason == "bracketed"


@pytest.mark.parametrize("tolerance", [-0.1, 1.0])
def test_a_tolerance_outside_0_to_1_is_a_value_error(tolerance):
    with pytest.raises(ValueError, match="0 <= tolerance < 1; got .*tolerance=" + str(tolerance)):
        search_largest_fit(lambda b: (True, 0), budget_bytes=1, start=1, max_batch_size=5, tolerance=tolerance)


def test_upper_bound_is_returned_when_everything_fits():
    fits = linear_oracle(1_000, 10, 10**12)
    result = search_largest_fit(fits, budget_bytes=10**12, start=10, max_batch_size=300)
    assert result.batch_size == 300 and result.stop_reason == "upper bound"
    assert result.trials[-1].batch_size == 300 and result.trials[-1].fits


def test_nothing_fits_returns_none_after_trying_the_minimum():
    fits = linear_oracle(5_000_000, 10_000, 1_000_000)
    result = search_largest_fit(fits, budget_bytes=1_000_000, start=64, max_batch_size=8192, min_batch_size=2)
    assert result.batch_size is None and result.stop_reason == "nothing fits"
    assert result.trials[-1].batch_size == 2 and not result.trials[-1].fits
    assert len(result.trials) <= 7


def test_max_trials_keeps_the_largest_tested_fit():
    fits = linear_oracle(3_000_000, 10_000, 13_000_000)
    result = search_largest_fit(fits, budget_bytes=13_000_000, start=2, max_batch_size=8192, max_trials=2)
    assert len(result.trials) == 2 and result.stop_reason == "max trials"
    assert result.batch_size == max(t.batch_size for t in result.trials if t.fits)


def test_no_multiple_in_range_is_a_value_error():
    with pytest.raises(ValueError, match="no multiple of multiple_of=8"):
        search_largest_fit(lambda b: (True, 0), budget_bytes=1, start=1, max_batch_size=5, multiple_of=8)


def test_prediction_needs_a_rising_line():
    assert predicted_largest_fit([], 100) is None
    assert predicted_largest_fit([(10, 500), (20, 500)], 1000) is None  # flat: no information
    assert predicted_largest_fit([(10, 500)], 1000, bytes_per_sample=10) == 60


# ----------------------------------------------------------------------------- wrong models
# The trial's outcome is decided by memory the measured peak does not show in full (the allocator,
# a cap measured elsewhere, a fixed extra only the real fit check sees): the line through the
# reported peaks is wrong, and the search must still get close to the true limit in few trials.


def wrong_model_oracle(limit: int, kind, per_sample: int = 10_000, fixed: int = 0):
    """Fits exactly up to ``limit``. ``kind`` a number: the reported peak is that times the real
    one; ``"hidden"``: a hidden constant (0.3 x the per-sample part at the limit) counts for the
    fit but not in the reported peak. Returns the oracle and the budget the search is given."""
    cap = fixed + per_sample * limit + per_sample // 2
    hidden = int(0.3 * per_sample * limit) if kind == "hidden" else 0
    budget = cap + hidden  # with a hidden constant, the line through the reported peaks says 1.3 x limit fits
    calls = []

    def fits(batch_size: int):
        calls.append(batch_size)
        real = fixed + hidden + per_sample * batch_size
        reported = real - hidden if kind == "hidden" else int(real * kind)
        return real <= budget, reported

    fits.calls = calls  # type: ignore[attr-defined]
    return fits, budget


def check_wrong_model(result, fits, limit: int, multiple_of: int) -> None:
    assert [t.batch_size for t in result.trials] == fits.calls  # every trial is a real call, in order
    for trial in result.trials:
        assert trial.batch_size % multiple_of == 0
        assert trial.fits == (trial.batch_size <= limit)
    assert result.batch_size == max(t.batch_size for t in result.trials if t.fits)  # tested and fitted


def test_an_under_reporting_peak_reaches_95_of_100_in_10_trials_like_lightnings_binsearch():
    # the meter reports 1/1.3 of what the step needs; the estimate (same meter) predicted 125
    per_sample, real_cap = 1_000_000, 100_500_000  # true limit 100
    fits, budget = wrong_model_oracle(100, 1 / 1.3, per_sample=per_sample)
    assert budget == real_cap
    assert predicted_largest_fit([], budget, per_sample / 1.3) is None
    assert predicted_largest_fit([(62, int(62 * per_sample / 1.3))], budget) >= 125  # the line says 125 fits
    result = search_largest_fit(
        fits, budget_bytes=budget, start=125, max_batch_size=8192, max_trials=10, bytes_per_sample=per_sample / 1.3
    )
    check_wrong_model(result, fits, 100, 1)
    assert len(result.trials) <= 10
    assert result.batch_size >= 95, [(t.batch_size, t.fits) for t in result.trials]


@pytest.mark.parametrize("limit", [100, 1000, 37, 5000])
def test_wrong_models_get_within_5_percent_of_the_limit_in_10_trials(limit):
    per_sample, failures = 10_000, []
    grid = itertools.product(
        [0.5, 0.77, 1.0, 1.3, "hidden"],  # reported peak / real peak, or a hidden constant
        [0.05, 1.25, 4.0],  # start: far below, just above, far above the limit
        [1, 8],  # multiple_of
        [0.0, 1.0],  # fixed part: none; as large as the batch's part at the limit
        [False, True],  # the estimate's slope: none; as wrong as the meter
    )
    for kind, start_factor, multiple_of, fixed_share, estimated in grid:
        fits, budget = wrong_model_oracle(limit, kind, per_sample, int(fixed_share * per_sample * limit))
        slope = per_sample * (1.0 if kind == "hidden" else kind) if estimated else None
        result = search_largest_fit(
            fits,
            budget_bytes=budget,
            start=max(1, int(limit * start_factor)),
            max_batch_size=8192,
            multiple_of=multiple_of,
            max_trials=10,
            bytes_per_sample=slope,
        )
        check_wrong_model(result, fits, limit, multiple_of)
        if (result.batch_size or 0) < 0.95 * round_down(limit, multiple_of):
            failures.append(
                (
                    kind,
                    start_factor,
                    multiple_of,
                    fixed_share,
                    estimated,
                    [(t.batch_size, int(t.fits)) for t in result.trials],
                )
            )
    assert not failures, failures


def test_a_line_whose_guesses_keep_missing_is_dropped_for_bisection():
    # superlinear peak: every line through two fits over-predicts, by a little once it is close,
    # so its guesses land inside the bracket and miss; after two such misses the search bisects
    def fits(batch_size: int):
        peak = 1_000 * batch_size + 3 * batch_size**2
        fits.calls.append(batch_size)
        return peak <= 40_000_000, peak

    fits.calls = []  # type: ignore[attr-defined]
    limit = max(b for b in range(1, 10_000) if 1_000 * b + 3 * b * b <= 40_000_000)
    result = search_largest_fit(fits, budget_bytes=40_000_000, start=2616, max_batch_size=8192, max_trials=10)
    check_wrong_model(result, fits, limit, 1)
    assert result.batch_size == limit == 3488, [(t.batch_size, t.fits) for t in result.trials]


def test_an_answer_that_does_not_hold_counts_as_a_miss_and_the_search_goes_on_below_it():
    # short trials fit up to 50; a longer run holds only up to ``holds`` (a GRU at the edge of its card)
    confirmed: list[int] = []
    holds = [49]

    def confirm(batch_size: int) -> bool:
        confirmed.append(batch_size)
        return batch_size <= holds[0]

    def search(**options: int) -> Any:
        confirmed.clear()
        fits = lambda b: (b <= 50, 1000 * b)  # noqa: E731
        return search_largest_fit(fits, budget_bytes=10**9, start=40, max_batch_size=50, confirm=confirm, **options)

    result = search()
    assert result.batch_size == 49 and confirmed == [50, 49] and result.stop_reason == "bracketed"
    # the refuted answer counts as a trial; the next size down is tried long at once
    assert [(trial.batch_size, trial.fits) for trial in result.trials] == [
        (40, True),
        (50, True),
        (50, False),
        (49, True),
    ]
    assert search(max_trials=2).batch_size == 49  # past max_trials too, the answer is confirmed
    holds[0] = 45  # the next size down does not hold either: the search goes on with confirmations only
    result = search(max_trials=20)
    after = [trial.batch_size for trial in result.trials[4:]]
    assert result.batch_size == 45 and confirmed[:2] == [50, 49] and confirmed[2:] == after and 46 in after
