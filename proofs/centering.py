"""Check proofs/centering.md: softmax is invariant exactly under constant logit shifts."""

from __future__ import annotations

import math

import numpy as np
from _check import PERTURB, check, finish


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def lse(x):
    m = x.max()
    return m + math.log(np.exp(x - m).sum())


def logit_checks(rng: np.random.Generator) -> None:
    for _ in range(500):
        n = int(rng.integers(2, 65))
        x = rng.uniform(-50, 50, n)
        V = rng.normal(size=(n, 4))
        c = float(rng.uniform(-1e3, 1e3))
        # --perturb: the shift is not quite constant (c plus a spread of about 1)
        shift = c + (rng.normal(size=n) if PERTURB else 0.0)
        s0, s1 = softmax(x), softmax(x + shift)
        check(np.max(np.abs(s1 - s0)) <= 1e-12 * max(1.0, s0.max()), "constant shift changed softmax")
        check(np.max(np.abs(s1 @ V - s0 @ V)) <= 1e-11 * (1 + np.abs(V).max()), "constant shift changed output")
        check(abs(lse(x + shift) - lse(x) - c) <= 1e-12 * (abs(c) + abs(lse(x))), "lse(x + c) != lse(x) + c")
        delta = rng.normal(size=n)
        delta[0] = delta[1] + 1e-3 * np.sign(rng.normal())  # spread >= 1e-3
        if PERTURB:  # a constant "non-constant" shift
            delta = np.full(n, delta[1])
        s2 = softmax(x + delta)
        # Part 2 (converse): a non-constant shift must change the softmax (V = I shows it in the
        # output). The ratios s2_i / s0_i = e^{delta_i} / E_s[e^delta] spread by a factor e^{ptp(delta)}.
        ratio = s2 / s0
        check(np.max(np.abs(ratio - 1)) > 1e-4, "non-constant shift left the softmax unchanged")


def dense64(q, k, v):
    logits = k @ q / math.sqrt(q.shape[-1])
    return softmax(logits) @ v, lse(logits)


def centering_checks(rng: np.random.Generator) -> None:
    d, n, sinks, local = 16, 48, 4, 8
    for _ in range(50):
        q = rng.normal(size=d) * 2
        offset = rng.normal(size=d) * 4  # keys in a cone: a common offset, as in real models
        k = rng.normal(size=(n, d)) + offset
        v = rng.normal(size=(n, d))
        kbar = k[sinks : n - local].mean(0)
        o0, l0 = dense64(q, k, v)
        # --perturb: "centering" subtracts a different multiple of the mean from each key
        scale = rng.uniform(0.5, 1.5, size=(n, 1)) if PERTURB else 1.0
        o1, l1 = dense64(q, k - scale * kbar, v)
        check(np.max(np.abs(o1 - o0)) < 1e-12, "centering every key changed the output")
        moved = q @ kbar / math.sqrt(d) * (-1 if PERTURB else 1)  # --perturb: the wrong sign
        check(abs(l1 - (l0 - moved)) < 1e-10, "centering moved the LSE by the wrong amount")
        k_partial = k.copy()
        k_partial[sinks : n - local] -= kbar
        o2, _ = dense64(q, k_partial, v)
        rel = np.linalg.norm(o2 - o0) / np.linalg.norm(o0)
        # --perturb claims the partial centering leaves the output unchanged
        changed = rel > 1e-3 or abs(q @ kbar) < 1e-9
        check(rel < 1e-12 if PERTURB else changed, f"partial centering changed the output by {rel:.3e}")


def library_checks(rng: np.random.Generator) -> None:
    import jax
    import jax.numpy as jnp

    from magicpig_jax import lsh
    from magicpig_jax.attention import MagicPIGConfig, build_lsh_index, dense_attention, magicpig_attention

    # 8 sinks, 64 hashed keys, 8 local keys. Integer keys and offset, a power-of-2 count of hashed
    # keys: the mean is exact in float32, so k + c - mean(k + c) equals k - mean(k) bit for bit and
    # the sampled set cannot change.
    cfg = MagicPIGConfig(K=4, L=8, num_sink=8, num_local=8)
    N = 80
    q = jnp.asarray(rng.normal(size=(2, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.integers(-4, 5, size=(2, 2, N, 16)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 2, N, 16)), jnp.float32)
    c = jnp.asarray(rng.integers(-8, 9, size=(2, 2, 1, 16)), jnp.float32)
    proj = lsh.simhash_projections(jax.random.key(0), 16, cfg.K, cfg.L)
    qc = np.einsum("bhgd,bhd->bhg", np.asarray(q, np.float64).reshape(2, 2, 2, 16), np.asarray(c, np.float64)[:, :, 0])
    qc = qc.reshape(2, 4) / 4.0

    def magicpig(kk, center):
        index = build_lsh_index(kk, proj, cfg, center=center)
        return magicpig_attention(q, kk, v, index, cfg), index

    # Something is hashed and sampled, and something is not: the check below is not about static keys
    # (--perturb: the first 16 keys only, all static, as a 16-key case with 8 sinks and 8 local keys).
    n_keys = 16 if PERTURB else N
    index = build_lsh_index(k[:, :, :n_keys], proj, cfg)
    _, _, num = magicpig_attention(q, k[:, :, :n_keys], v[:, :, :n_keys], index, cfg)
    hashed = int(np.min(np.asarray(index.end - index.start)))
    check(hashed == 64 and 0 < int(np.sum(num)) < 64 * 8, f"hashed {hashed} keys, sampled {int(np.sum(num))}")
    # MagicPIG with centering (--perturb: without) is invariant to adding c to every key: the
    # centered keys, hence the codes and the sampled set, are the same.
    (o0, l0, n0), _ = magicpig(k, not PERTURB)
    (o1, l1, n1), _ = magicpig(k + c, not PERTURB)
    same = bool(np.array_equal(np.asarray(n0), np.asarray(n1)))
    check(same and float(jnp.max(jnp.abs(o1 - o0))) < 1e-4,
          "magicpig: adding a constant key vector changed the output")
    check(same and np.max(np.abs(np.asarray(l1) - np.asarray(l0) - qc)) < 1e-3,
          "magicpig: lse did not move by q.c/sqrt(d)")
    # Dense attention likewise (--perturb: c added to the hashed range only, as partial centering).
    part = jnp.zeros((N, 1)).at[8 : N - 8].set(1.0) if PERTURB else 1.0
    o0, l0 = dense_attention(q, k, v)
    o1, l1 = dense_attention(q, k + c * part, v)
    check(float(jnp.max(jnp.abs(o1 - o0))) < 1e-4, "dense: adding a constant key vector changed the output")
    check(np.max(np.abs(np.asarray(l1) - np.asarray(l0) - qc)) < 1e-3, "dense: lse did not move by q.c/sqrt(d)")


def main() -> None:
    rng = np.random.default_rng(0)
    logit_checks(rng)
    centering_checks(rng)
    library_checks(rng)
    finish("centering")


if __name__ == "__main__":
    main()
