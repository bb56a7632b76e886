"""Check proofs/oracle_sampling.md (Theorem 3.2) by exact enumeration and a library Monte Carlo."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction as F

import numpy as np
from _check import PERTURB, check, finish

WEIGHTS = [
    [F(1, 2), F(1, 4), F(1, 8), F(1, 8)],
    [F(1, 4)] * 4,
    [F(7, 10), F(1, 10), F(1, 10), F(1, 10)],
    [F(1), F(0), F(0), F(0)],
]
VALUES = [(F(1), F(-2)), (F(3), F(0)), (F(-1, 2), F(5)), (F(2), F(2))]


def moments(w, v):
    o = [sum(wi * vi[d] for wi, vi in zip(w, v, strict=True)) for d in range(2)]
    sigma = [
        [sum(wi * vi[a] * vi[b] for wi, vi in zip(w, v, strict=True)) - o[a] * o[b] for b in range(2)]
        for a in range(2)
    ]
    return o, sigma


def claimed_cov(sigma, B):
    scale = F(1, B * B) if PERTURB else F(1, B)
    return [[s * scale for s in row] for row in sigma]


def by_sequences(w, v, B):
    """Exact mean and covariance of the estimator over all n^B index sequences."""
    mean = [F(0), F(0)]
    second = [[F(0), F(0)], [F(0), F(0)]]
    for seq in itertools.product(range(len(w)), repeat=B):
        prob = math.prod((w[i] for i in seq), start=F(1))
        if prob == 0:
            continue
        est = [sum(v[i][d] for i in seq) / B for d in range(2)]
        for a in range(2):
            mean[a] += prob * est[a]
            for b in range(2):
                second[a][b] += prob * est[a] * est[b]
    cov = [[second[a][b] - mean[a] * mean[b] for b in range(2)] for a in range(2)]
    return mean, cov


def by_multisets(w, v, B):
    """Same, summing over count vectors with multinomial probabilities (n = len(w))."""
    n = len(w)
    mean = [F(0), F(0)]
    second = [[F(0), F(0)], [F(0), F(0)]]
    for cuts in itertools.combinations(range(B + n - 1), n - 1):
        counts = [b - a - 1 for a, b in itertools.pairwise((-1, *cuts, B + n - 1))]
        coef = math.factorial(B)
        for c in counts:
            coef //= math.factorial(c)
        prob = coef * math.prod((wi**c for wi, c in zip(w, counts, strict=True)), start=F(1))
        est = [sum(c * vi[d] for c, vi in zip(counts, v, strict=True)) / B for d in range(2)]
        for a in range(2):
            mean[a] += prob * est[a]
            for b in range(2):
                second[a][b] += prob * est[a] * est[b]
    cov = [[second[a][b] - mean[a] * mean[b] for b in range(2)] for a in range(2)]
    return mean, cov


def claimed_mean(o, v):
    """E[o_B] = o (--perturb: the plain average of the values, as if the draws were uniform)."""
    return [sum(vi[d] for vi in v) / len(v) for d in range(2)] if PERTURB else o


def exact_checks() -> None:
    all_traces = []
    for w in WEIGHTS:
        o, sigma = moments(w, VALUES)
        traces = []
        for B in range(1, 7):
            mean, cov = by_sequences(w, VALUES, B)
            check(mean == claimed_mean(o, VALUES), f"E[o_B] != o for w={w}, B={B}")
            check(cov == claimed_cov(sigma, B), f"Cov(o_B) != Sigma/B for w={w}, B={B}")
            traces.append(cov[0][0] + cov[1][1])
        all_traces.append(traces)
        tr_sigma = sigma[0][0] + sigma[1][1]
        if tr_sigma > 0:
            order = traces[::-1] if PERTURB else traces  # --perturb: the trace grows with B
            check(all(a > b for a, b in itertools.pairwise(order)), f"trace not strictly decreasing for w={w}")
        else:
            # --perturb: zero covariance claimed for the uniform weights instead
            zero = all_traces[1] if PERTURB else traces
            check(all(t == 0 for t in zero), f"one-hot weights must give zero covariance, w={w}")
    w3, v3 = [F(3, 5), F(3, 10), F(1, 10)], VALUES[:3]
    o, sigma = moments(w3, v3)
    for B in (7, 20, 40):
        mean, cov = by_multisets(w3, v3, B)
        check(mean == o and cov == claimed_cov(sigma, B), f"multiset enumeration fails at B={B}")


def library_check() -> None:
    import jax
    import jax.numpy as jnp

    from magicpig_jax.attention import dense_attention, oracle_sampling_attention

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 2, 8)) * 2, jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 40, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, 1, 40, 8)), jnp.float32)
    S, B = 400, 16
    outs = jax.jit(jax.vmap(lambda r: oracle_sampling_attention(r, q, k, v, B)[0]))(
        jax.random.split(jax.random.key(0), S)
    )
    outs = np.asarray(outs, np.float64)
    o = np.asarray(dense_attention(q, k, v)[0], np.float64)
    logits = np.asarray(q, np.float64)[0] @ np.asarray(k, np.float64)[0, 0].T / math.sqrt(8)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    vn = np.asarray(v, np.float64)[0, 0]
    var = w @ vn**2 - o[0] ** 2  # diagonal of Sigma per head
    se = np.sqrt(var / (B * S))
    claimed = vn.mean(0) if PERTURB else o[0]  # --perturb: the plain average of the values
    check(bool(np.all(np.abs(outs.mean(0)[0] - claimed) <= 6 * se + 1e-6)), "library mean outside 6 SE of dense")
    emp = outs.var(0, ddof=1).sum(-1)[0]
    claimed = var.sum(-1) / (B * B if PERTURB else B)
    check(bool(np.all(np.abs(emp / claimed - 1) < 0.3)), f"library trace {emp} vs Sigma/B {claimed}")


def main() -> None:
    exact_checks()
    library_check()
    finish("oracle_sampling")


if __name__ == "__main__":
    main()
