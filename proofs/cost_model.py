"""Check proofs/cost_model.md: E[#sampled] = sum u_i, monotonicity in (K, L), and the L solver."""

from __future__ import annotations

import math

import numpy as np
from _check import PERTURB, check, finish
from scipy import stats


def u64(cos, K, L):
    p = 1 - np.arccos(np.clip(np.asarray(cos, np.float64), -1, 1)) / np.pi
    return stats.binom.sf(1, L, p**K)


def claimed_count(cos, K, L):
    if PERTURB:
        p = 1 - np.arccos(np.clip(cos, -1, 1)) / np.pi
        return float(np.sum(L * p**K))
    return float(np.sum(u64(cos, K, L)))


def expected_count_check() -> None:
    import jax
    import jax.numpy as jnp

    from magicpig_jax import lsh

    D, n, R = 16, 48, 300
    rng = np.random.default_rng(0)
    qv = rng.normal(size=D)
    qh = qv / np.linalg.norm(qv)
    target_cos = np.linspace(-0.6, 0.9, n)
    perp = rng.normal(size=(n, D))
    perp -= np.outer(perp @ qh, qh)
    perp /= np.linalg.norm(perp, axis=1, keepdims=True)
    keys = target_cos[:, None] * qh + np.sqrt(1 - target_cos[:, None] ** 2) * perp
    keys *= rng.uniform(0.5, 5, (n, 1))
    x = jnp.asarray(np.vstack([qv, keys]), jnp.float32)
    cos = (np.asarray(x[1:], np.float64) @ np.asarray(x[0], np.float64)) / (
        np.linalg.norm(np.asarray(x[1:], np.float64), axis=1) * np.linalg.norm(np.asarray(x[0], np.float64))
    )
    for K, L in ((4, 10), (8, 60), (10, 150)):

        @jax.jit
        def counts(rs, K=K, L=L):
            def one(r):
                c = lsh.simhash_codes(x, lsh.simhash_projections(r, D, K, L), K, L)
                return jnp.sum(jnp.sum(c[1:] == c[:1], axis=-1) >= 2)

            return jax.vmap(one)(rs)

        c = np.asarray(counts(jax.random.split(jax.random.key(K * 7 + L), R)), np.float64)
        se = c.std(ddof=1) / math.sqrt(R)
        want = claimed_count(cos, K, L)
        check(abs(c.mean() - want) <= 6 * se, f"K={K} L={L}: mean count {c.mean():.3f} vs {want:.3f} (se {se:.3f})")


def monotonicity_check() -> None:
    for P in np.concatenate([np.geomspace(1e-6, 0.5, 30), np.linspace(0.55, 0.99, 10)]):
        Ls = np.arange(2, 302)
        u = stats.binom.sf(1, Ls, P)
        diff = np.diff(u)
        formula = Ls[:-1] * P**2 * (1 - P) ** (Ls[:-1] - 1)
        ok = formula > 1e-200
        # Differences of u lose relative precision when u ~ 1; compare where both are well resolved.
        resolved = ok & (u[:-1] < 0.5)
        # --perturb: u decreasing in L
        check(bool(np.all(diff[ok] <= 0) if PERTURB else np.all(diff[ok] >= 0)), f"u not increasing in L at P={P}")
        if PERTURB:  # the increment without its factor L
            formula = P**2 * (1 - P) ** (Ls[:-1] - 1)
        rel = np.abs(diff[resolved] - formula[resolved]) / formula[resolved]
        check(rel.max(initial=0) < 1e-9, f"u(L+1)-u(L) != L P^2 (1-P)^(L-1) at P={P}: {rel.max(initial=0)}")
    for p in np.linspace(0.05, 0.95, 19):
        for L in (2, 10, 150):
            uk = stats.binom.sf(1, L, p ** np.arange(1, 33))
            if PERTURB:  # u increasing in K
                uk = uk[::-1]
            check(bool(np.all(np.diff(uk) <= 0)) and uk[0] > uk[-1], f"u not decreasing in K at p={p}, L={L}")


def solver_check() -> None:
    from magicpig_jax.attention.cost_model import tables_for_fraction

    rng = np.random.default_rng(1)
    dists = {
        "narrow": np.clip(rng.normal(0, 0.08, 2000), -1, 1),
        "wide": np.clip(rng.normal(0, 0.25, 2000), -1, 1),
        "tail": np.clip(np.concatenate([rng.normal(0, 0.08, 1900), 1 - rng.exponential(0.2, 100)]), -1, 1),
    }
    for name, cos in dists.items():
        for K in (8, 10, 11):
            for target in (0.01, 0.02, 0.05):
                L = tables_for_fraction(cos, K, target)
                # --perturb: claims that one table fewer reaches the target, and one more does not
                L_at, L_next = (L - 1, L + 1) if PERTURB else (L, L)
                f_at = float(np.mean(u64(cos, K, L_at))) if L_at >= 2 else 0.0
                f_below = float(np.mean(u64(cos, K, L_next - 1))) if L_next > 2 else -1.0
                check(f_at >= target * (1 - 1e-4), f"{name} K={K}: f(L*={L}) = {f_at} < {target}")
                check(f_below < target * (1 + 1e-4), f"{name} K={K}: f(L*-1={L - 1}) = {f_below} >= {target}")


def notes_numbers_check() -> None:
    tables = 1 if PERTURB else 2  # --perturb: a collision in >= 1 table samples a key
    u0 = float(stats.binom.sf(tables - 1, 150, 0.5**10))
    u5 = float(stats.binom.sf(tables - 1, 150, (1 - np.arccos(0.5) / np.pi) ** 10))
    check(abs(u0 - 0.0097) < 5e-5, f"K10L150 orthogonal: {u0}")
    check(abs(u5 - 0.74) < 5e-3, f"K10L150 cos 0.5: {u5}")


def main() -> None:
    expected_count_check()
    monotonicity_check()
    solver_check()
    notes_numbers_check()
    finish("cost_model")


if __name__ == "__main__":
    main()
