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


def simhash_counts(keys: np.ndarray, q: np.ndarray, K: int, L: int, rng, draws: int) -> np.ndarray:
    """Collision counts X [draws, n] of independent SimHash index draws: K Gaussian hyperplanes per table."""
    w = rng.normal(size=(draws, keys.shape[1], K * L))
    kb = (np.einsum("nd,rdc->rnc", keys, w) > 0).reshape(draws, len(keys), L, K)
    qb = (np.einsum("d,rdc->rc", q, w) > 0).reshape(draws, 1, L, K)
    return np.sum(np.all(kb == qb, axis=-1), axis=-1)


def item_2() -> None:
    rng = np.random.default_rng(1)
    n, d, K, L, m = 40, 6, 2, 8, 3
    q = rng.normal(size=d)
    keys = rng.normal(size=(n, d)) + 1.2 * q / np.linalg.norm(q)  # a cone around the query: many heavy keys
    vals = rng.normal(size=(n, 3))
    logits = keys @ q / math.sqrt(d)
    wt = np.exp(logits - logits.max())
    o = wt @ vals / wt.sum()
    cos = keys @ q / (np.linalg.norm(keys, axis=1) * np.linalg.norm(q))
    P = (1 - np.arccos(np.clip(cos, -1, 1)) / math.pi) ** K
    lw = np.array([light_weight(L, float(Pi), m) for Pi in P])
    # 20,000 draws: the perturbed weights (1/u for the light keys, a bias of -h (1 - u) / u per key)
    # then sit well outside 5 standard errors, whatever the seed
    R = 20_000
    X = np.concatenate([simhash_counts(keys, q, K, L, rng, 2_000) for _ in range(R // 2_000)])
    t = np.where(X >= m, 1.0, np.where(X >= 2, lw, 0.0))
    num = (t * wt) @ vals
    den = (t * wt).sum(1)
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


def library_checks() -> None:
    """The library implements this estimator: ``log_light_probability`` is ``log u_c`` over the grid, and
    ``hybrid_attention`` on one index draw equals the estimate computed here from the draw's counts."""
    import jax
    import jax.numpy as jnp

    from magicpig_jax import lsh
    from magicpig_jax.attention import HybridConfig, build_lsh_index, hybrid_attention
    from magicpig_jax.attention.hybrid import log_light_probability

    worst = 0.0
    for K, L, m, p in GRID:
        if m > L:  # nothing light beyond the last table count: u_c = u, no perturbed variant to tell apart
            continue
        got = float(log_light_probability(jnp.float32(p), K, L, m))
        want = -math.log(light_weight(L, float(np.float32(p)) ** K, m))  # --perturb: log u
        if math.isfinite(want):
            worst = max(worst, abs(math.expm1(got - want)))
    check(worst < 1e-4, f"log_light_probability: worst relative error of u_c {worst:.2e}")

    rng = np.random.default_rng(3)
    n, d, K, L, m = 48, 8, 2, 8, 4
    q = rng.normal(size=d)
    keys = rng.normal(size=(n, d)) + 1.0 * q / np.linalg.norm(q)
    vals = rng.normal(size=(n, d))
    cfg = HybridConfig(K=K, L=L, num_sink=0, num_local=0, heavy=m)
    proj = lsh.simhash_projections(jax.random.key(9), d, K, L)
    k4 = jnp.asarray(keys[None, None], jnp.float32)
    v4 = jnp.asarray(vals[None, None], jnp.float32)
    q3 = jnp.asarray(q[None, None], jnp.float32)
    index = build_lsh_index(k4, proj, cfg, center=False)
    out, lse, _ = hybrid_attention(q3, k4, v4, index, cfg)
    # the same draw's counts, in float64 from the hyperplanes
    w = np.asarray(proj, np.float64)
    kf, qf = np.asarray(k4[0, 0], np.float64), np.asarray(q3[0, 0], np.float64)
    X = np.sum(np.all(((kf @ w) > 0).reshape(n, L, K) == ((qf @ w) > 0).reshape(1, L, K), axis=-1), axis=-1)
    cos = kf @ qf / (np.linalg.norm(kf, axis=1) * np.linalg.norm(qf))
    P = (1 - np.arccos(np.clip(cos, -1, 1)) / math.pi) ** K
    t = np.where(X >= m, 1.0, np.where(X >= 2, [light_weight(L, float(Pi), m) for Pi in P], 0.0))
    logits = kf @ qf / math.sqrt(d)
    a = t * np.exp(logits - logits.max())
    want_out = a @ np.asarray(v4[0, 0], np.float64) / a.sum()
    want_lse = logits.max() + math.log(a.sum())
    print(f"library draw: {int((X >= m).sum())} heavy, {int(((X >= 2) & (X < m)).sum())} light keys of {n}")
    out_err = np.max(np.abs(np.asarray(out[0, 0], np.float64) - want_out))
    check(out_err < 1e-5 and abs(float(lse[0, 0]) - want_lse) < 1e-5,
          "hybrid_attention differs from the estimate of its own draw")


if __name__ == "__main__":
    items_1_and_3()
    item_3_minimum()
    item_2()
    library_checks()
    finish("hybrid")
