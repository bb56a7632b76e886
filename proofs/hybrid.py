"""Check proofs/hybrid.md: the hybrid's terms are unbiased, its per-key variance is (1-u)(1-h)/(u-h) >= MagicPIG's,
and pooled SimHash draws converge to the attention output."""

from __future__ import annotations

import math

import numpy as np
from _check import PERTURB, check, finish


def pmf(L: int, P: float) -> np.ndarray:
    """Exact Binomial(L, P) probabilities of X = 0..L (float64, math.comb)."""
    return np.array([math.comb(L, x) * P**x * (1 - P) ** (L - x) for x in range(L + 1)])


def light_weight(L: int, P: float, m: int) -> float:
    """1/c = P[X < m] / P[2 <= X < m] (the claim); perturbed: 1/u = 1 / P[X >= 2]."""
    f = pmf(L, P)
    if PERTURB:
        return 1.0 / f[2:].sum()
    return f[:m].sum() / f[2:m].sum()


def terms(L: int, P: float, m: int) -> np.ndarray:
    """t^H as a function of X = 0..L."""
    x = np.arange(L + 1)
    return np.where(x >= m, 1.0, np.where(x >= 2, light_weight(L, P, m), 0.0))


GRID = [(K, L, m, p) for K, L in ((1, 2), (2, 6), (4, 10), (10, 150), (6, 40)) for m in (3, 5, L + 1)
        if m <= L + 1 for p in (0.3, 0.6, 0.8, 0.9, 0.97, 0.995)]


def items_1_and_3() -> None:
    worst_mean = worst_var = worst_diff = 0.0
    for K, L, m, p in GRID:
        P = p**K
        f = pmf(L, P)
        t = terms(L, P, m)
        # the probabilities as sums of the pmf (no 1 - u cancellation when u is close to 1)
        u, h, r, s, one_minus_h = f[2:].sum(), f[m:].sum(), f[:2].sum(), f[2:m].sum(), f[:m].sum()
        if s <= 1e-300:
            continue
        mean = float((f * t).sum())
        var = float((f * (t - mean) ** 2).sum())  # float64: meaningful to ~1e-16 of E t^2 = O(1)
        worst_mean = max(worst_mean, abs(mean - 1))
        var_claim = r * one_minus_h / s
        worst_var = max(worst_var, abs(var - var_claim) / max(var_claim, 1e-6))
        diff_claim = r * r * h / (u * s)
        var_mp = float((f[2:] * (1 / u - 1) ** 2).sum() + r)  # t = 1{X >= 2}/u around its mean 1
        worst_diff = max(worst_diff, abs((var - var_mp) - diff_claim) / max(var_claim, 1e-6))
    check(worst_mean < 1e-9, f"item 1: max |E t^H - 1| = {worst_mean:.3e}")
    check(worst_var < 1e-9, f"item 3: max relative error of Var t^H = (1-u)(1-h)/(u-h): {worst_var:.3e}")
    check(worst_diff < 1e-9, f"item 3: max error of Var t^H - Var t = (1-u)^2 h / (u (u-h)): {worst_diff:.3e}")


def item_3_minimum() -> None:
    """Random admissible weights f (0 below 2, E f = 1) have E f^2 >= 1/u; the hybrid's terms are one of them."""
    rng = np.random.default_rng(0)
    worst = math.inf
    for K, L, m, p in GRID:
        P = p**K
        f = pmf(L, P)
        u = f[2:].sum()
        for _ in range(50):
            g = np.where(np.arange(L + 1) >= 2, rng.random(L + 1) + 0.01, 0.0)
            g /= (f * g).sum()
            worst = min(worst, (f * g * g).sum() * u)
        t = terms(L, P, m)  # admissible (E t = 1): u E t^2 >= 1; with --perturb it is biased and drops below 1
        worst = min(worst, (f * t * t).sum() * u)
    check(worst >= 1 - 1e-9, f"item 3: min over admissible f of u E f^2 = {worst:.6f} (must be >= 1)")


def simhash_counts(keys: np.ndarray, q: np.ndarray, K: int, L: int, rng) -> np.ndarray:
    """Collision counts X_i of one SimHash index draw: K Gaussian hyperplanes per table."""
    w = rng.normal(size=(keys.shape[1], K * L))
    kb = (keys @ w > 0).reshape(len(keys), L, K)
    qb = (q @ w > 0).reshape(L, K)
    return np.sum(np.all(kb == qb[None], axis=-1), axis=-1)


def item_2() -> None:
    rng = np.random.default_rng(1)
    n, d, K, L, m = 40, 6, 2, 8, 4
    q = rng.normal(size=d)
    keys = rng.normal(size=(n, d)) + 1.2 * q / np.linalg.norm(q)  # a cone around the query: many heavy keys
    vals = rng.normal(size=(n, 3))
    logits = keys @ q / math.sqrt(d)
    wt = np.exp(logits - logits.max())
    o = wt @ vals / wt.sum()
    cos = keys @ q / (np.linalg.norm(keys, axis=1) * np.linalg.norm(q))
    P = (1 - np.arccos(np.clip(cos, -1, 1)) / math.pi) ** K
    lw = np.array([light_weight(L, float(Pi), m) for Pi in P])
    R = 4000
    num = np.zeros((R, 3))
    den = np.zeros(R)
    for r in range(R):
        X = simhash_counts(keys, q, K, L, rng)
        t = np.where(X >= m, 1.0, np.where(X >= 2, lw, 0.0))
        num[r] = (t * wt) @ vals
        den[r] = (t * wt).sum()
    # unnormalized sum: mean over draws vs sum w v, CLT bound
    se_num = num.std(0, ddof=1) / math.sqrt(R)
    err_num = np.abs(num.mean(0) - wt @ vals)
    check(bool(np.all(err_num <= 5 * se_num)),
          f"item 1 (Monte Carlo): |mean - sum w v| = {err_num} vs 5 se {5 * se_num}")
    # pooled self-normalized estimate vs o, delta-method standard error
    pooled = num.sum(0) / den.sum()
    lin = num - np.outer(den, o)
    se = lin.std(0, ddof=1) / math.sqrt(R) / den.mean()
    err = np.abs(pooled - o)
    check(bool(np.all(err <= 5 * se)), f"item 2: pooled |o_R - o| = {err} vs 5 se {5 * se}")


if __name__ == "__main__":
    items_1_and_3()
    item_3_minimum()
    item_2()
    finish("hybrid")
