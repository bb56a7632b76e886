"""Check proofs/lse_merge.md: the LSE merge is exact, commutative and associative."""

from __future__ import annotations

import itertools
import math

import numpy as np
from _check import PERTURB, check, finish

LOG_BASE = math.log(2) if PERTURB else 1.0  # --perturb: treat a base-2 LSE as natural


def partial(x, v, idx, base=None):
    """(o_A, l_A) in float64; l is a natural log unless --perturb (then base 2), or ``l / base``."""
    base = LOG_BASE if base is None else base
    if len(idx) == 0:
        return np.zeros(v.shape[1]), -math.inf
    xa = x[idx]
    m = xa.max()
    e = np.exp(xa - m)
    return e @ v[idx] / e.sum(), (m + math.log(e.sum())) / base


def merge_naive(a, b):
    """The merge without the max shift: exp of each LSE (overflows beyond about 709)."""
    (oa, la), (ob, lb) = a, b
    with np.errstate(over="ignore", invalid="ignore"):
        wa, wb = np.exp(np.float64(la)), np.exp(np.float64(lb))
        return (wa * oa + wb * ob) / (wa + wb), np.log(wa + wb)


def merge(a, b):
    (oa, la), (ob, lb) = a, b
    m = max(la, lb)
    if m == -math.inf:
        return np.zeros_like(oa), -math.inf
    wa = 0.0 if la == -math.inf else math.exp(la - m)
    wb = 0.0 if lb == -math.inf else math.exp(lb - m)
    return (wa * oa + wb * ob) / (wa + wb), m + math.log(wa + wb)


def trees(parts):
    """Every full binary bracketing of the sequence ``parts`` (Catalan many)."""
    if len(parts) == 1:
        yield parts[0]
        return
    for i in range(1, len(parts)):
        for left in trees(parts[:i]):
            for right in trees(parts[i:]):
                yield merge(left, right)


def reference_checks(rng: np.random.Generator) -> None:
    for case in range(300):
        n = int(rng.integers(1, 41))
        x = rng.normal(size=n) * (10 if case % 3 == 0 else 2)
        v = rng.normal(size=(n, 3))
        labels = rng.integers(0, 4, n)
        parts = [partial(x, v, np.flatnonzero(labels == j)) for j in range(4)]
        o_all, l_all = partial(x, v, np.arange(n))
        if PERTURB:
            l_all *= LOG_BASE  # compare with the true (natural) LSE of the union
        for order in itertools.permutations(range(4)):
            for o, lse in trees([parts[j] for j in order]):
                check(np.max(np.abs(o - o_all)) < 1e-12 * (1 + np.abs(o_all).max()), f"case {case}: output mismatch")
                check(abs(lse - l_all) <= 1e-12 * (1 + abs(l_all)), f"case {case}: lse mismatch")
    # Far-apart LSEs: no overflow (--perturb: the merge without the max shift).
    o, lse = (merge_naive if PERTURB else merge)((np.ones(2), 1500.0), (-np.ones(2), 0.0))
    check(np.all(np.isfinite(o)) and abs(lse - 1500.0) < 1e-12 and np.allclose(o, 1.0), "far-apart merge overflowed")
    # Base-2 LSEs in the natural-log merge are wrong (the bug the check guards against;
    # --perturb: natural LSEs, which merge correctly).
    x = np.array([0.0, 1.0, 5.0, -2.0])
    v = np.array([[1.0], [2.0], [-3.0], [4.0]])
    base = 1.0 if PERTURB else math.log(2)
    o_bad, _ = merge(partial(x, v, [0, 1], base), partial(x, v, [2, 3], base))
    o_true = partial(x, v, [0, 1, 2, 3], 1.0)[0]
    check(abs(o_bad[0] - o_true[0]) / abs(o_true[0]) > 1e-3, "a base-2 LSE merged correctly (it must not)")


def library_checks(rng: np.random.Generator) -> None:
    import jax.numpy as jnp

    from magicpig_jax.attention import merge_attention

    for case in range(20):
        n = 30
        x = rng.normal(size=(n,)) * 4
        v = rng.normal(size=(n, 8))
        labels = rng.integers(0, 3, n)
        if case == 0:
            labels[labels == 1] = 0  # an empty middle part
        parts = [partial(x, v, np.flatnonzero(labels == j)) for j in range(3)]
        o_all, l_all = partial(x, v, np.arange(n))
        outs = [jnp.asarray(p[0][None], jnp.float32) for p in parts]
        lses = [jnp.asarray([p[1]], jnp.float32) for p in parts]
        o, lse = merge_attention(*merge_attention(outs[0], lses[0], outs[1], lses[1]), outs[2], lses[2])
        o2, lse2 = merge_attention(outs[0], lses[0], *merge_attention(outs[1], lses[1], outs[2], lses[2]))
        for oo, ll in ((o, lse), (o2, lse2)):
            if PERTURB:  # the merge without the max shift, on LSEs 1000 higher: inf / inf
                oo = merge_naive((np.asarray(outs[0][0]), float(lses[0][0]) + 1000),
                                 (np.asarray(outs[2][0]), float(lses[2][0]) + 1000))[0][None]
            check(bool(np.all(np.isfinite(np.asarray(oo)))), "library merge produced NaN/inf")
            check(float(np.max(np.abs(np.asarray(oo[0], np.float64) - o_all))) < 1e-5, "library merge output")
            check(abs(float(ll[0]) - l_all * (LOG_BASE if PERTURB else 1)) < 1e-5 * (1 + abs(l_all)), "library lse")


def library_far_apart_checks() -> None:
    """``merge_attention`` itself on LSEs far apart (1500 and 0, beyond float32's exp range) and on an
    empty part (LSE -inf): the result is the dominant part's (--perturb: the merge without the max shift)."""
    import jax.numpy as jnp

    from magicpig_jax.attention import merge_attention

    oa, ob = np.array([[1.0, 2.0]]), np.array([[-3.0, 5.0]])
    for la, lb, want_o, want_l in ((1500.0, 0.0, oa, 1500.0), (0.0, 1500.0, ob, 1500.0),
                                   (-math.inf, 2.5, ob, 2.5), (-1e30, 3e30, ob, 3e30)):
        if PERTURB:
            o, lse = merge_naive((oa[0], la), (ob[0], lb))
            o, lse = np.asarray(o)[None], np.asarray([lse])
        else:
            o, lse = merge_attention(jnp.asarray(oa, jnp.float32), jnp.asarray([la], jnp.float32),
                                     jnp.asarray(ob, jnp.float32), jnp.asarray([lb], jnp.float32))
        o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
        check(bool(np.all(np.isfinite(o))) and np.allclose(o, want_o) and abs(lse[0] - want_l) <= 1e-6 * abs(want_l),
              f"library merge of LSEs {la} and {lb}: {o}, {lse}")


def main() -> None:
    rng = np.random.default_rng(0)
    reference_checks(rng)
    library_checks(rng)
    library_far_apart_checks()
    finish("lse_merge")


if __name__ == "__main__":
    main()
