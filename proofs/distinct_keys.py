"""Check proofs/distinct_keys.md (Theorem 3.3): E[distinct] = sum 1-(1-w_i)^B <= 1 + B eps."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction as F

import numpy as np
from _check import PERTURB, check, finish

SLACK = F(1, 2) if PERTURB else F(1)


def claimed_expectation(w, B):
    """E[distinct] = sum_i 1 - (1 - w_i)^B (--perturb: sum_i min(1, B w_i), the expected draws per key capped at 1)."""
    if PERTURB:
        return sum(min(1, B * wi) for wi in w)
    return sum(1 - (1 - wi) ** B for wi in w)


def exact_checks() -> None:
    weights = [
        [F(1, 2), F(1, 4), F(1, 4)],
        [F(9, 10), F(1, 20), F(1, 40), F(1, 40)],
        [F(1, 4)] * 4,
        [F(1), F(0), F(0)],
        [F(2, 3), F(1, 3)],
    ]
    for w in weights:
        eps = 1 - max(w)
        for B in range(1, 7):
            expect = F(0)
            for seq in itertools.product(range(len(w)), repeat=B):
                prob = math.prod((w[i] for i in seq), start=F(1))
                expect += prob * len(set(seq))
            check(expect == claimed_expectation(w, B), f"E[distinct] != formula for w={w}, B={B}")
            formula = sum(1 - (1 - wi) ** B for wi in w)
            check(formula <= 1 + B * eps * SLACK, f"bound fails for w={w}, B={B}: {formula} > 1 + {B}*{eps}")


def float_checks(rng: np.random.Generator) -> None:
    cases = []
    for alpha in (0.01, 0.1, 1.0, 10.0):
        cases += list(rng.dirichlet(np.full(50, alpha), size=400))
    n = np.arange(1, 301)
    cases += [n**-1.1 / np.sum(n**-1.1), n**-2.0 / np.sum(n**-2.0), np.full(300, 1 / 300), np.eye(1, 300)[0]]
    for w in cases:
        eps = 1 - w.max()
        for B in (1, 2, 5, 16, 64, 512):
            with np.errstate(divide="ignore"):  # w_i = 1: log1p(-1) = -inf, term = 1 exactly
                formula = np.sum(-np.expm1(B * np.log1p(-w)))
            check(formula <= 1 + B * eps * float(SLACK) + 1e-12, f"float bound fails: B={B}, eps={eps}")


def library_check() -> None:
    import jax
    import jax.numpy as jnp

    from magicpig_jax.attention import oracle_sampling_attention

    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(1, 2, 8)) * 3, jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 64, 8)), jnp.float32)
    v = jnp.zeros((1, 1, 64, 8), jnp.float32)
    S, B = 300, 24
    d = jax.jit(jax.vmap(lambda r: oracle_sampling_attention(r, q, k, v, B)[2]))(jax.random.split(jax.random.key(1), S))
    d = np.asarray(d, np.float64)[:, 0]
    logits = np.asarray(q, np.float64)[0] @ np.asarray(k, np.float64)[0, 0].T / math.sqrt(8)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    formula = np.sum(1 - (1 - w) ** B, -1)
    claimed = np.sum(np.minimum(1, B * w), -1) if PERTURB else formula
    se = d.std(0, ddof=1) / math.sqrt(S)
    check(bool(np.all(np.abs(d.mean(0) - claimed) <= 6 * se + 1e-9)), f"library {d.mean(0)} vs {claimed}")
    check(bool(np.all(formula <= 1 + B * (1 - w.max(-1)) * float(SLACK))), "bound fails for the library case")


def main() -> None:
    exact_checks()
    float_checks(np.random.default_rng(0))
    library_check()
    finish("distinct_keys")


if __name__ == "__main__":
    main()
