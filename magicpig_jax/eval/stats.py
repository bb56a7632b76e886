"""95% confidence intervals for the summary of ``magicpig-jax eval`` (pure Python + NumPy).

Every figure of the summary is a mean over independent samples (task samples, likelihood
documents), so each gets an interval:

* :func:`wilson_interval` — a proportion of 0/1 outcomes (a needle found or not): the Wilson
  score interval (Wilson, JASA 1927), which stays inside [0, 1] and keeps close to its nominal
  coverage for small n and proportions near 0 or 1, where the normal ("Wald") interval fails
  (Brown, Cai & DasGupta, Statistical Science 2001).
* :func:`t_interval` — the mean of real-valued per-sample figures (a document's KL, perplexity
  or top-1 agreement, ms per decode step): Student's t interval
  ``mean ± t_{0.975, n-1} s / sqrt(n)``. The t quantile is computed here
  (:func:`t_quantile`, from the regularized incomplete beta function) so that SciPy is not a
  run-time dependency.
* :func:`effective_size_wilson_interval` — a mean of per-task mean scores in [0, 1] (the mean task
  accuracy): Wilson's interval at the equal-weight mean's effective sample size (Kish).
  A task whose samples all scored 1 keeps its share of the uncertainty, which a bootstrap over
  the samples gives it none of.
* :func:`newcombe_paired_interval` — the difference of two methods' scores in [0, 1] on the same
  samples: Newcombe's hybrid score interval for paired proportions (Newcombe 1998, method 10),
  which does not collapse to a point when the two methods agree on every sample, as the paired
  t interval does; fractional scores take it at their means, with their covariance over the
  variances Wilson assumes.
* :func:`interval_for_scores` — a mean score in [0, 1]: Wilson's interval at the mean, exact
  Wilson for 0/1 scores. A t interval has zero width when every sample scores alike (0.25 on
  each multi-value sample).

An interval over fewer than 2 samples is ``(None, None)`` except the score intervals, which are
defined for n >= 1.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

__all__ = [
    "Z95",
    "wilson_interval",
    "t_quantile",
    "t_interval",
    "interval_for_scores",
    "effective_size_wilson_interval",
    "newcombe_paired_interval",
    "paired_t_interval",
    "sign_test",
    "regularized_incomplete_beta",
]

Z95 = 1.959963984540054  # the 0.975 quantile of the standard normal


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float | None, float | None]:
    """The Wilson score interval of a binomial proportion.

    ``(p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)`` with ``p = successes / n``.

    Args:
      successes: number of successes, ``0 <= successes <= n``.
      n: number of trials, ``>= 0``.
      z: the normal quantile (default: 95% two-sided).

    Returns:
      ``(low, high)`` in ``[0, 1]``; ``(None, None)`` for ``n == 0``.

    Raises:
      ValueError: ``n`` not an integer ``>= 0``, ``successes`` outside ``[0, n]``, or ``z`` not a
        finite number ``> 0``.

    Source: E. B. Wilson, "Probable inference, the law of succession, and statistical
    inference", JASA 22 (1927).
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got n={n!r}")
    if not (_is_number(successes) and 0 <= successes <= n):
        raise ValueError(f"need 0 <= successes <= n, got successes={successes!r}, n={n}")
    _check_z(z)
    if n == 0:
        return None, None
    return _score_interval(successes / n, n, z, successes == 0, successes == n)


def _is_number(v) -> bool:
    """A real Python or NumPy number (not a bool, nor a JAX or NumPy array)."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _check_z(z) -> None:
    """Refuse a ``z`` that is not a finite number > 0: a negative one swapped the limits (low above
    high), 0 gave a point and NaN the whole of [0, 1], each without a word."""
    if not (_is_number(z) and 0.0 < z < math.inf):
        raise ValueError(f"z must be a finite number > 0 (a normal quantile: {Z95} for 95%), got z={z!r}")


def _score_interval(p: float, n: float, z: float, at_zero: bool, at_one: bool) -> tuple[float, float]:
    """Wilson's interval for an estimate ``p`` of a proportion at (effective) sample size ``n > 0``;
    exact at the ends when ``p`` is exactly 0 or 1 (no rounding residue)."""
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(max(p * (1 - p), 0.0) / n + z2 / (4 * n * n)) / denom
    lo = 0.0 if at_zero else max(0.0, center - half)
    hi = 1.0 if at_one else min(1.0, center + half)
    return lo, hi


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """``I_x(a, b)`` by the continued fraction of Numerical Recipes (modified Lentz), ``a, b > 0``.

    Source: Press et al., Numerical Recipes, 3rd ed., Section 6.4 (``betai``/``betacf``).

    Raises:
      ValueError: ``x`` outside ``[0, 1]``.
    """
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    return _incomplete_beta(a, b, x, 1.0 - x, math.log(x), math.log1p(-x))


def _incomplete_beta(a: float, b: float, x: float, y: float, log_x: float, log_y: float) -> float:
    """``I_x(a, b)`` for ``0 < x < 1`` given ``y = 1 - x`` and both logarithms, computed by the caller
    without cancellation or underflow (near ``x = 1``, ``1.0 - x`` keeps few digits of ``y``; ``x``
    itself may underflow to 0 where its log does not)."""
    if x > (a + 1) / (a + b + 2):  # the continued fraction converges fast on this side only
        return 1.0 - _incomplete_beta(b, a, y, x, log_y, log_x)
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * log_x + b * log_y
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((a + m2 - 1) * (a + m2)),
                    -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(log_front) * h / a


def _t_masses(t: float, df: float) -> tuple[float, float]:
    """``(P(0 < T < t), P(T > t))`` for ``t >= 0``, each computed without cancellation: the central
    mass from ``I_w(1/2, df/2)``, the tail from ``I_v(df/2, 1/2)``, ``w = t²/(df + t²)``, ``v = 1 - w``
    (from ``s = t/√df`` so that neither overflows)."""
    if t == 0.0:
        return 0.0, 0.5
    s = t / math.sqrt(df)
    if s <= 1.0:
        w, v = s * s / (1.0 + s * s), 1.0 / (1.0 + s * s)
        log_v = -math.log1p(s * s)
        log_w = 2 * math.log(s) + log_v
    else:
        r = 1.0 / s
        w, v = 1.0 / (1.0 + r * r), r * r / (1.0 + r * r)
        log_w = -math.log1p(r * r)
        log_v = math.log(df) - 2 * math.log(t) + log_w  # 2 log r, where r may underflow
    return (0.5 * _incomplete_beta(0.5, df / 2, w, v, log_w, log_v),
            0.5 * _incomplete_beta(df / 2, 0.5, v, w, log_v, log_w))


def _cornish_fisher_t(z: float, df: float) -> float:
    """Student's t quantile from the normal one ``z`` (Abramowitz & Stegun 26.7.5), for large ``df``."""
    z2 = z * z
    g = ((z2 + 1) / 4, ((5 * z2 + 16) * z2 + 3) / 96, (((3 * z2 + 19) * z2 + 17) * z2 - 15) / 384,
         ((((79 * z2 + 776) * z2 + 1482) * z2 - 1920) * z2 - 945) / 92160)
    return z * (1 + sum(gi / df ** (i + 1) for i, gi in enumerate(g)))


_LARGE_DF = 1e5  # past it the continued fraction needs more terms than it gets; A&S 26.7.5 is exact in float64


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df > 0`` degrees of freedom.

    Bisection on the CDF, from the central mass for ``0.25 <= p <= 0.75`` and from the tail mass
    beyond, each from the incomplete beta function without cancellation or underflow, to about
    1e-10 relative for any ``p`` (``scipy.stats.t.ppf``, and its closed forms at ``df`` 1 and 2
    where SciPy's own saturates near 1e153); for ``df > 1e5``, the Cornish–Fisher expansion of the
    normal quantile (Abramowitz & Stegun 26.7.5).

    Returns:
      The quantile; ``±inf`` when it is beyond the float range (``p`` of about ``1e-308`` at ``df = 1``).

    Raises:
      ValueError: ``p`` outside ``(0, 1)`` or ``df`` not a positive finite number (naming which).
    """
    if not (isinstance(p, (int, float, np.floating)) and 0.0 < p < 1.0):
        raise ValueError(f"p must be in (0, 1), got p={p!r}")
    if not (isinstance(df, (int, float, np.integer, np.floating)) and 0.0 < df < math.inf):
        raise ValueError(f"df must be a positive finite number, got df={df!r}")
    p, df = float(p), float(df)
    if p == 0.5:
        return 0.0
    sign = 1.0 if p > 0.5 else -1.0
    if df > _LARGE_DF:
        from statistics import NormalDist

        return _cornish_fisher_t(NormalDist().inv_cdf(p), df)
    central = 0.25 <= p <= 0.75
    target = abs(p - 0.5) if central else min(p, 1.0 - p)  # both exact in float64 (Sterbenz)

    def below(t: float) -> bool:  # is t below the quantile |t_p|?
        c, u = _t_masses(t, df)
        return c < target if central else u > target

    lo, hi = 0.0, 1.0
    while below(hi):
        if hi == sys.float_info.max:  # the quantile is beyond the float range
            return sign * math.inf
        lo, hi = hi, min(2.0 * hi, sys.float_info.max)
    while lo == 0.0 and not below(0.5 * hi) and hi > 1e-300:
        hi *= 0.5
    lo = 0.5 * hi if lo == 0.0 else lo
    for _ in range(200):
        mid = lo + 0.5 * (hi - lo)  # (lo + hi) overflows near the largest float
        if below(mid):
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * hi:
            break
    return sign * (lo + 0.5 * (hi - lo))


def _clean(xs: Sequence[float | None]) -> np.ndarray:
    return np.asarray([x for x in xs if x is not None and math.isfinite(x)], np.float64)


def t_interval(xs: Sequence[float | None], confidence: float = 0.95) -> tuple[float | None, float | None]:
    """Student's t interval of the mean of ``xs`` (None and non-finite values dropped).

    Returns:
      ``(low, high)``; ``(None, None)`` with fewer than 2 values; an interval of width about ``1e-16 ×
      mean`` when they are all equal (the standard deviation's rounding).

    Raises:
      ValueError: ``confidence`` outside ``(0, 1)``.
    """
    if not (isinstance(confidence, (int, float, np.floating)) and 0.0 < confidence < 1.0):
        raise ValueError(f"confidence must be in (0, 1), got confidence={confidence!r}")
    x = _clean(xs)
    n = x.size
    if n < 2:
        return None, None
    mean = float(x.mean())
    sd = float(x.std(ddof=1))
    half = t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return mean - half, mean + half


def interval_for_scores(scores: Sequence[float | None]) -> tuple[float | None, float | None, str | None]:
    """The interval of a mean score in [0, 1] over independent samples.

    Wilson's score interval (:func:`wilson_interval`) when every score is 0 or 1. Fractional
    scores (e.g. 3 of 4 expected strings: 0.75) get Wilson's interval at their mean ``p̄`` and
    sample count, i.e. with the variance ``p (1 - p)`` of a 0/1 score of that mean, the largest
    any score in [0, 1] of mean ``p`` can have: wider than the t interval, and unlike it not of
    zero width when every sample scores alike (0.25 on each of 20 samples gives t ``[25, 25]``).

    Args:
      scores: per-sample scores in [0, 1]; None and non-finite values are dropped.

    Returns:
      ``(low, high, method)`` in [0, 1] with method ``"wilson"`` (0/1 scores), ``"wilson-mean"``
      (fractional) or None (no score).

    Raises:
      ValueError: a score outside [0, 1].

    Source: E. B. Wilson (1927); the bound on the variance of a [0, 1] variable is Bhatia–Davis.
    """
    x = _clean(scores)
    if x.size == 0:
        return None, None, None
    bad = [float(v) for v in x if not 0.0 <= v <= 1.0]
    if bad:
        raise ValueError(f"interval_for_scores: scores must be in [0, 1], got {bad[0]}")
    if np.all((x == 0) | (x == 1)):
        lo, hi = wilson_interval(float(x.sum()), int(x.size))
        return lo, hi, "wilson"
    lo, hi = effective_size_wilson_interval([x])
    return lo, hi, "wilson-mean"


def effective_size_wilson_interval(groups: Sequence[Sequence[float | None]],
                                   z: float = Z95) -> tuple[float | None, float | None]:
    """The interval of the mean of per-group mean scores in [0, 1] (each group weighted equally).

    Wilson's score interval at the estimate ``p̄ = mean_t(mean of group t)`` and Kish's effective
    sample size of that weighted mean, ``n_eff = (sum_i w_i)² / sum_i w_i² = T² / sum_t(1 / n_t)``
    (each of group t's ``n_t`` samples weighs ``1 / (T n_t)``): the size at which ``p̄`` of a
    proportion common to the groups has the variance ``p (1 - p) / n_eff``. It is exact Wilson for
    one group, and Wilson of the pooled counts for groups of equal size. A group whose samples all
    scored 1 (or 0) adds its share of uncertainty; a bootstrap that resamples the samples gives it
    none.

    Its coverage is approximately nominal, not guaranteed: it inherits Wilson's dips near 0 and 1
    (exact coverage down to about 0.84 for one group of 20); at equal sizes, groups whose
    proportions differ have a smaller true variance than the one assumed (``x (1 - x)`` is concave),
    and fractional scores a variance at most ``μ (1 - μ)``, both of which widen it; at very unequal
    sizes it can be too narrow (exact coverage 0.875 for groups of 4 and 40 samples at proportions
    0.5 and 1). The eval's tasks have equal sample counts.

    Args:
      groups: the scores of each group (e.g. of each task), each in [0, 1]; None and non-finite
        values are dropped, then empty groups.
      z: the normal quantile (default: 95% two-sided).

    Returns:
      ``(low, high)`` in [0, 1]; ``(None, None)`` when no group has a score.

    Raises:
      ValueError: a score outside [0, 1], or ``z`` not a finite number ``> 0``.

    Source: E. B. Wilson (1927) at L. Kish's effective sample size (*Survey Sampling*, 1965). It
    is not the stratified Wilson interval of Yan & Su (2010), which combines each group's Wilson
    limits and agrees with this one only when the groups' proportions are equal.
    """
    _check_z(z)
    gs = [g for g in (_clean(g) for g in groups) if g.size]
    if not gs:
        return None, None
    bad = [float(v) for g in gs for v in g if not 0.0 <= v <= 1.0]
    if bad:
        raise ValueError(f"effective_size_wilson_interval: scores must be in [0, 1], got {bad[0]}")
    t = len(gs)
    p = sum(float(g.mean()) for g in gs) / t
    n_eff = t * t / sum(1.0 / g.size for g in gs)
    return _score_interval(p, n_eff, z, all(np.all(g == 0) for g in gs), all(np.all(g == 1) for g in gs))


def newcombe_paired_interval(xs: Sequence[float], ys: Sequence[float],
                             z: float = Z95) -> tuple[float | None, float | None]:
    """The interval of the mean paired difference ``x_i - y_i`` of scores in [0, 1] (same samples).

    For 0/1 scores, with ``a`` samples where both score 1, ``b`` where only x does, ``c`` where
    only y does and ``d`` where neither does, the difference of the proportions
    ``p1 = (a + b) / n`` and ``p2 = (a + c) / n`` has the interval

        ``δ - sqrt((p1 - l1)² - 2 φ (p1 - l1)(u2 - p2) + (u2 - p2)²)``,
        ``δ + sqrt((p2 - l2)² - 2 φ (p2 - l2)(u1 - p1) + (u1 - p1)²)``

    where ``(l1, u1)`` and ``(l2, u2)`` are the Wilson intervals of ``p1`` and ``p2`` and ``φ`` is
    the correlation of the 2 × 2 table, its numerator ``ad - bc`` lowered by ``n / 2`` toward 0
    when positive (0 when the table has an empty margin). Unlike the paired t interval, it keeps a
    width when the two agree on every sample (no discordant pair in 20: about ±16 pp when both
    always score 1).

    Fractional scores use the same formula with the moments it is written in: ``p1, p2`` the mean
    scores, their Wilson intervals at ``n`` (:func:`interval_for_scores`'s, which assume the
    largest variance ``p (1 - p)`` a score of that mean can have), and ``φ`` the sample covariance
    over those assumed variances: numerator ``n Σ x y - Σ x Σ y`` (``ad - bc`` for 0/1 scores),
    denominator ``sqrt((n Σ x - (Σ x)²)(n Σ y - (Σ y)²))`` (``n² sqrt(p1 q1 p2 q2)``; the
    table's margins for 0/1 scores). Dividing by the scores' own variances instead (their
    Pearson correlation) paired the assumed variances with a correlation they do not have: for
    x in {0, 1} and y = 0.25 + 0.5 x its exact coverage fell to 0.73 at n = 100. It is identical to
    method 10 on 0/1 scores; on fractional ones an approximation (no published coverage), chosen
    because the paired t interval has zero width when every pair differs alike (0.25 against 0.25
    on each sample: Δ 0 [0, 0]).

    Args:
      xs, ys: the two methods' scores, each in [0, 1], in the same sample order.
      z: the normal quantile (default: 95% two-sided).

    Returns:
      ``(low, high)`` within [-1, 1]; ``(None, None)`` for no pair.

    Raises:
      ValueError: ``xs`` and ``ys`` differ in length, a score is not a number in [0, 1] (NumPy
        numbers and booleans are, a JAX scalar is not: convert with ``float``), or ``z`` is not a
        finite number ``> 0``.

    Source: R. G. Newcombe, "Improved confidence intervals for the difference between binomial
    proportions based on paired data", Statistics in Medicine 17 (1998), method 10.
    """
    if len(xs) != len(ys):
        raise ValueError(f"paired samples need equal lengths, got {len(xs)} and {len(ys)}")
    _check_z(z)
    bad = [v for v in (*xs, *ys)
           if not (isinstance(v, (int, float, np.integer, np.floating, np.bool_)) and 0 <= v <= 1)]
    if bad:
        kind = "" if isinstance(bad[0], (int, float, np.integer, np.floating, np.bool_)) else \
            f" of type {type(bad[0]).__name__} (scores must be Python or NumPy numbers)"
        raise ValueError(f"newcombe_paired_interval: scores must be in [0, 1], got {bad[0]!r}{kind}")
    n = len(xs)
    if n == 0:
        return None, None
    x, y = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
    sx, sy = float(x.sum()), float(y.sum())
    p1, p2 = sx / n, sy / n
    l1, u1 = _score_interval(p1, n, z, sx == 0, sx == n)
    l2, u2 = _score_interval(p2, n, z, sy == 0, sy == n)
    # 0/1 scores: these are the table's ad - bc and (a+b)(c+d)(a+c)(b+d), exactly (integer sums); the
    # denominator is the variances Wilson assumes, n² p q, not the scores' own
    margins = (n * sx - sx * sx) * (n * sy - sy * sy)
    num = n * float(x @ y) - sx * sy
    num = max(num - n / 2, 0.0) if num > 0 else num
    phi = num / math.sqrt(margins) if margins > 0 else 0.0
    delta = p1 - p2
    lo = delta - math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    hi = delta + math.sqrt(max((p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2, 0.0))
    return max(lo, -1.0), min(hi, 1.0)


def paired_t_interval(xs: Sequence[float], ys: Sequence[float],
                      confidence: float = 0.95) -> tuple[float | None, float | None]:
    """The t interval of the mean paired difference ``x_i - y_i`` (same samples, two methods).

    Raises:
      ValueError: ``xs`` and ``ys`` differ in length.
    """
    if len(xs) != len(ys):
        raise ValueError(f"paired samples need equal lengths, got {len(xs)} and {len(ys)}")
    return t_interval([x - y for x, y in zip(xs, ys, strict=True)], confidence)


def sign_test(xs: Sequence[float], ys: Sequence[float]) -> tuple[int, int, float | None]:
    """The exact two-sided sign test of paired samples: is ``x_i > y_i`` as likely as ``x_i < y_i``?

    It reads only each pair's direction, so one outlying pair cannot hide a consistent direction
    as it widens a t interval (per-document KL differences are heavily skewed). Ties (equal pairs)
    are dropped.

    Returns:
      ``(higher, n, p)``: pairs with ``x > y``, pairs that differ, and the two-sided p-value
      ``min(1, 2 P[Binomial(n, 1/2) <= min(higher, n - higher)])`` (None when ``n == 0``).

    Raises:
      ValueError: ``xs`` and ``ys`` differ in length, or a pair holds NaN (it has no direction).

    Source: the binomial sign test (Conover, *Practical Nonparametric Statistics*, Section 3.4).
    """
    if len(xs) != len(ys):
        raise ValueError(f"paired samples need equal lengths, got {len(xs)} and {len(ys)}")
    d = [x - y for x, y in zip(xs, ys, strict=True) if x is not None and y is not None]
    if any(math.isnan(v) for v in d):  # no direction: a NaN pair is not a tie
        raise ValueError("sign_test: a pair holds NaN")
    higher = int(sum(bool(v > 0) for v in d))  # Python ints: a NumPy int64 2 ** n wraps to 0
    n = higher + int(sum(bool(v < 0) for v in d))
    if n == 0:
        return 0, 0, None
    k = min(higher, n - higher)
    tail = Fraction(sum(math.comb(n, i) for i in range(k + 1)), 2**n)  # exact: 2.0**n overflows past n = 1023
    return higher, n, float(min(Fraction(1), 2 * tail))
