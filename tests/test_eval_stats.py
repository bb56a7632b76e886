"""magicpig_jax.eval.stats: the 95% intervals of the eval summary against SciPy / float64 references."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import special
from scipy import stats as sst

from magicpig_jax.eval.stats import (
    interval_for_scores,
    paired_t_interval,
    regularized_incomplete_beta,
    sign_test,
    stratified_bootstrap_interval,
    t_interval,
    t_quantile,
    wilson_interval,
)


@given(st.floats(0.5005, 0.9995), st.floats(0.5, 2000))
def test_t_quantile_matches_scipy(p, df):
    assert t_quantile(p, df) == pytest.approx(sst.t.ppf(p, df), rel=1e-9, abs=1e-9)
    assert t_quantile(1 - p, df) == pytest.approx(sst.t.ppf(1 - p, df), rel=1e-9, abs=1e-9)


@given(st.floats(0.05, 50), st.floats(0.05, 50), st.floats(0, 1))
def test_incomplete_beta_matches_scipy(a, b, x):
    assert regularized_incomplete_beta(a, b, x) == pytest.approx(special.betainc(a, b, x), rel=1e-9, abs=1e-12)


def wilson_ref(k, n):
    """The Wilson interval as the roots of (p̂ - p)² = z² p (1 - p) / n (float64 quadratic)."""
    z = sst.norm.ppf(0.975)
    ph = k / n
    a = 1 + z * z / n
    b = -(2 * ph + z * z / n)
    c = ph * ph
    disc = math.sqrt(max(b * b - 4 * a * c, 0.0))
    return (-b - disc) / (2 * a), (-b + disc) / (2 * a)


@given(st.integers(1, 500), st.data())
def test_wilson_is_the_score_interval(n, data):
    k = data.draw(st.integers(0, n))
    lo, hi = wilson_interval(k, n)
    rlo, rhi = wilson_ref(k, n)
    assert lo == pytest.approx(max(rlo, 0.0), abs=1e-12) and hi == pytest.approx(min(rhi, 1.0), abs=1e-12)
    assert 0 <= lo <= k / n <= hi <= 1


def test_wilson_coverage_is_near_nominal():
    """Exact coverage (sum over the binomial) of the Wilson interval at n = 20 is within [0.90, 0.99]."""
    n = 20
    for p in (0.1, 0.3, 0.5, 0.8):
        cover = sum(sst.binom.pmf(k, n, p) for k in range(n + 1)
                    if wilson_interval(k, n)[0] <= p <= wilson_interval(k, n)[1])
        assert 0.90 <= cover <= 0.99, (p, cover)
    assert wilson_interval(0, 0) == (None, None)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


@given(st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=40))
def test_t_interval_matches_scipy(xs):
    lo, hi = t_interval(xs)
    x = np.asarray(xs, np.float64)
    if np.ptp(x) == 0:
        assert lo == pytest.approx(x[0]) and hi == pytest.approx(x[0])
        return
    rlo, rhi = sst.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=x.std(ddof=1) / math.sqrt(len(x)))
    assert lo == pytest.approx(rlo, rel=1e-7, abs=1e-9) and hi == pytest.approx(rhi, rel=1e-7, abs=1e-9)


def test_t_interval_drops_missing_and_needs_two():
    assert t_interval([1.0, None, float("nan")]) == (None, None)
    lo, hi = t_interval([1.0, None, 3.0])
    assert lo < 2 < hi


def test_interval_for_scores_picks_wilson_or_t():
    lo, hi, how = interval_for_scores([1, 0, 1, 1])
    assert how == "wilson" and (lo, hi) == wilson_interval(3, 4)
    lo, hi, how = interval_for_scores([0.5, 0.25, 1.0])
    assert how == "t" and 0 <= lo < hi <= 1
    assert interval_for_scores([]) == (None, None, None)


@settings(max_examples=20)
@given(st.lists(st.lists(st.sampled_from([0.0, 1.0]), min_size=2, max_size=30), min_size=1, max_size=4),
       st.integers(0, 1000))
def test_stratified_bootstrap_brackets_the_mean(groups, seed):
    lo, hi = stratified_bootstrap_interval(groups, resamples=500, seed=seed)
    mean = float(np.mean([np.mean(g) for g in groups]))
    assert lo <= mean + 1e-12 and mean - 1e-12 <= hi
    assert stratified_bootstrap_interval(groups, resamples=500, seed=seed) == (lo, hi)  # reproducible


def test_stratified_bootstrap_shrinks_like_one_over_sqrt_n():
    rng = np.random.default_rng(0)
    small = [list(rng.integers(0, 2, 20).astype(float))]
    big = [list(rng.integers(0, 2, 2000).astype(float))]
    w_small = np.subtract(*stratified_bootstrap_interval(small)[::-1])
    w_big = np.subtract(*stratified_bootstrap_interval(big)[::-1])
    assert 5 < w_small / w_big < 15  # sqrt(100) = 10


def test_paired_t_interval():
    x, y = [1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0]
    lo, hi = paired_t_interval(x, y)
    d = np.subtract(x, y)
    rlo, rhi = sst.t.interval(0.95, 3, loc=d.mean(), scale=d.std(ddof=1) / 2)
    assert (lo, hi) == pytest.approx((rlo, rhi))
    assert paired_t_interval([1.0, 1.0], [1.0, 1.0]) == (0.0, 0.0)
    with pytest.raises(ValueError):
        paired_t_interval([1.0], [1.0, 2.0])


@given(st.lists(st.tuples(st.integers(-3, 3), st.integers(-3, 3)), min_size=0, max_size=40))
def test_sign_test_matches_scipy_binomtest(pairs):
    xs, ys = [float(a) for a, _ in pairs], [float(b) for _, b in pairs]
    higher, n, p = sign_test(xs, ys)
    d = np.subtract(xs, ys)
    assert (higher, n) == (int((d > 0).sum()), int((d != 0).sum()))
    if n == 0:
        assert p is None
    else:
        assert p == pytest.approx(sst.binomtest(higher, n, 0.5).pvalue, rel=1e-9)


def test_sign_test_sees_a_direction_an_outlier_hides_from_the_t_interval():
    # 13 of 16 documents higher by a little, one far lower (a skewed KL difference, as measured)
    d = [0.001] * 13 + [-0.0005] * 2 + [-0.03]
    lo, hi = t_interval(d)
    assert lo < 0 < hi  # the t interval calls it a tie
    higher, n, p = sign_test(d, [0.0] * 16)
    assert (higher, n) == (13, 16) and p == pytest.approx(sst.binomtest(13, 16).pvalue) and p < 0.05
    with pytest.raises(ValueError):
        sign_test([1.0], [1.0, 2.0])


def test_sign_test_is_exact_past_a_thousand_pairs_and_refuses_nan():
    """2.0 ** n overflowed once 1024 pairs differed (a summary of 1,100 documents crashed)."""
    rng = np.random.default_rng(0)
    d = rng.normal(0.05, 1.0, 1500)
    higher, n, p = sign_test(list(d), [0.0] * len(d))
    assert n == 1500 and p == pytest.approx(sst.binomtest(higher, n, 0.5).pvalue, rel=1e-9)
    with pytest.raises(ValueError, match="a pair holds NaN"):
        sign_test([1.0, math.nan], [0.0, 0.0])
