"""Check proofs/simhash_collision.md: P[same bit] = 1 - theta/pi and u = P[Bin(L, p^K) >= 2]."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
from _check import PERTURB, check, finish
from scipy import stats

CONF = 1 - 1e-6


def claimed_p(theta: float) -> float:
    return 1 - theta / (2 * math.pi) if PERTURB else 1 - theta / math.pi


def disagreement_measure(alpha: float, theta: float) -> float:
    """Exact measure (over directions phi in [0, 2 pi)) where sign cos(phi - a) != sign cos(phi - a - theta)."""
    cuts = sorted(
        {(alpha + s * math.pi / 2) % (2 * math.pi) for s in (1, 3)}
        | {(alpha + theta + s * math.pi / 2) % (2 * math.pi) for s in (1, 3)}
    )
    cuts = cuts + [cuts[0] + 2 * math.pi]
    total = 0.0
    for a, b in itertools.pairwise(cuts):
        mid = (a + b) / 2  # signs are constant on each arc between critical directions
        if (math.cos(mid - alpha) > 0) != (math.cos(mid - alpha - theta) > 0):
            total += b - a
    return total


def part1_exact() -> None:
    worst = 0.0
    for theta in np.linspace(1e-6, math.pi - 1e-6, 2001):
        agree = 1 - disagreement_measure(0.3, float(theta)) / (2 * math.pi)
        worst = max(worst, abs(agree - claimed_p(float(theta))))
    check(worst < 1e-12, f"part 1 exact: max |P[same bit] - p| = {worst:.3e}")


def part1_monte_carlo(rng: np.random.Generator) -> None:
    d, n = 16, 200_000
    r = rng.normal(size=(n, d))
    for theta in np.linspace(0.05, math.pi - 0.05, 12):
        basis, _ = np.linalg.qr(rng.normal(size=(d, 2)))
        x = basis[:, 0] * 3.0
        y = (math.cos(theta) * basis[:, 0] + math.sin(theta) * basis[:, 1]) * 0.2
        same = int(np.sum((r @ x > 0) == (r @ y > 0)))
        ci = stats.binomtest(same, n, claimed_p(theta)).proportion_ci(confidence_level=CONF)
        check(ci.low <= claimed_p(theta) <= ci.high, f"part 1 MC theta={theta:.3f}: {same / n} vs {claimed_p(theta)}")


def closed_form(P: Fraction, L: int) -> Fraction:
    if PERTURB:  # a collision in >= 1 table
        return 1 - (1 - P) ** L
    return 1 - (1 - P) ** L - L * P * (1 - P) ** (L - 1)


def naive_log_u(p: np.ndarray, K: int, L: int) -> np.ndarray:
    """log of the closed form evaluated directly in float32: cancels for small L p^K (to 0 or below)."""
    P = p.astype(np.float32) ** np.float32(K)
    with np.errstate(divide="ignore", invalid="ignore"):
        one = np.float32(1)
        u = one - (one - P) ** np.float32(L) - np.float32(L) * P * (one - P) ** np.float32(L - 1)
        return np.log(u).astype(np.float64)


def part2_exact() -> None:
    for L in range(2, 13):
        for P in (Fraction(1, 7), Fraction(1, 2), Fraction(3, 4), Fraction(1, 1000), Fraction(999, 1000)):
            total = Fraction(0)
            for pattern in itertools.product((0, 1), repeat=L):  # 1 = codes equal in that table
                hits = sum(pattern)
                prob = P**hits * (1 - P) ** (L - hits)
                total += prob if hits >= 2 else 0
            check(total == closed_form(P, L), f"part 2 exact L={L} P={P}")


def part2_library() -> None:
    import jax
    import jax.numpy as jnp

    from magicpig_jax import lsh

    D, R = 8, 2000
    rng = np.random.default_rng(1)
    for K, L, thetas in ((1, 2, (1.0, 2.5)), (3, 10, (0.5, 0.9)), (10, 150, (math.pi / 2, 0.6))):
        basis, _ = np.linalg.qr(rng.normal(size=(D, 2)))
        x = [basis[:, 0]] + [math.cos(t) * basis[:, 0] + math.sin(t) * basis[:, 1] for t in thetas]
        x = jnp.asarray(np.stack(x), jnp.float32)  # the query and one key per angle

        @jax.jit
        def sampled(keys, x=x, K=K, L=L):
            def one(key):
                c = lsh.simhash_codes(x, lsh.simhash_projections(key, D, K, L), K, L)
                return jnp.sum(c[1:] == c[:1], axis=-1) >= 2

            return jnp.sum(jax.vmap(one)(keys), axis=0)

        counts = np.asarray(sampled(jax.random.split(jax.random.key(K * 1000 + L), R)))
        for j, theta in enumerate(thetas):
            p = float(lsh.collision_probability(x[0], x[j + 1]))
            if PERTURB:
                p = 1 - math.acos(math.cos(theta)) / (2 * math.pi)
            u = float(lsh.sampling_probability(jnp.float32(p), K, L))
            ci = stats.binomtest(int(counts[j]), R, u).proportion_ci(confidence_level=CONF)
            check(
                ci.low <= u <= ci.high,
                f"part 2 library MC K={K} L={L} theta={theta:.3f}: {counts[j] / R} vs u={u:.5f}",
            )

    # float32 u against SciPy's float64 binomial tail.
    p = np.unique(np.concatenate([np.linspace(0, 1, 2001), np.geomspace(1e-6, 0.02, 100)]).astype(np.float32))
    log_u_fn = jax.jit(lsh.log_sampling_probability, static_argnums=(1, 2))
    for K in (1, 10, 32):
        for L in (2, 150, 2000):
            log_u = np.asarray(log_u_fn(jnp.asarray(p), K, L), np.float64)
            if PERTURB:  # the closed form, directly in float32
                log_u = naive_log_u(p, K, L)
            ref = stats.binom.sf(1, L, p.astype(np.float64) ** K)
            big = ref >= 1e-30
            with np.errstate(invalid="ignore"):
                rel = np.abs(np.exp(log_u[big]) - ref[big]) / ref[big]
            check(not np.any(np.isnan(log_u)), f"log u NaN for K={K} L={L}")
            check(np.nanmax(rel) < 1e-4 and not np.any(np.isnan(rel)),
                  f"library u rel. error {np.nanmax(rel):.2e} for K={K} L={L}")


def main() -> None:
    rng = np.random.default_rng(0)
    part1_exact()
    part1_monte_carlo(rng)
    part2_exact()
    part2_library()
    finish("simhash_collision")


if __name__ == "__main__":
    main()
