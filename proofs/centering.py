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
        s0, s1 = softmax(x), softmax(x + c)
        check(np.max(np.abs(s1 - s0)) <= 1e-12 * max(1.0, s0.max()), "constant shift changed softmax")
        check(np.max(np.abs(s1 @ V - s0 @ V)) <= 1e-11 * (1 + np.abs(V).max()), "constant shift changed output")
        check(abs(lse(x + c) - lse(x) - c) <= 1e-12 * (abs(c) + abs(lse(x))), "lse(x + c) != lse(x) + c")
        delta = rng.normal(size=n)
        delta[0] = delta[1] + 1e-3 * np.sign(rng.normal())  # spread >= 1e-3
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
        o1, l1 = dense64(q, k - kbar, v)
        check(np.max(np.abs(o1 - o0)) < 1e-12, "centering every key changed the output")
        check(abs(l1 - (l0 - q @ kbar / math.sqrt(d))) < 1e-10, "centering moved the LSE by the wrong amount")
        k_partial = k.copy()
        k_partial[sinks : n - local] -= kbar
        o2, _ = dense64(q, k_partial, v)
        rel = np.linalg.norm(o2 - o0) / np.linalg.norm(o0)
        if PERTURB:
            check(rel < 1e-12, f"partial centering changed the output by {rel:.3e}")
        else:
            check(rel > 1e-3 or abs(q @ kbar) < 1e-9, f"partial centering changed the output only by {rel:.3e}")


def library_checks(rng: np.random.Generator) -> None:
    import jax
    import jax.numpy as jnp

    from magicpig_jax import lsh
    from magicpig_jax.attention import MagicPIGConfig, build_lsh_index, dense_attention, magicpig_attention

    cfg = MagicPIGConfig(K=4, L=8, num_sink=8, num_local=8)  # N = 16: every key static, no sampling noise
    q = jnp.asarray(rng.normal(size=(2, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 2, 16, 16)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 2, 16, 16)), jnp.float32)
    c = jnp.asarray(rng.normal(size=(2, 2, 1, 16)) * 3, jnp.float32)
    proj = lsh.simhash_projections(jax.random.key(0), 16, cfg.K, cfg.L)
    qc = np.einsum("bhgd,bhd->bhg", np.asarray(q, np.float64).reshape(2, 2, 2, 16), np.asarray(c, np.float64)[:, :, 0])
    qc = qc.reshape(2, 4) / 4.0
    for name, fn in (
        ("magicpig", lambda kk: magicpig_attention(q, kk, v, build_lsh_index(kk, proj, cfg), cfg)[:2]),
        ("dense", lambda kk: dense_attention(q, kk, v)),
    ):
        o0, l0 = fn(k)
        o1, l1 = fn(k + c)
        check(float(jnp.max(jnp.abs(o1 - o0))) < 1e-4, f"{name}: adding a constant key vector changed the output")
        check(np.max(np.abs(np.asarray(l1) - np.asarray(l0) - qc)) < 1e-3, f"{name}: lse did not move by q.c/sqrt(d)")


def main() -> None:
    rng = np.random.default_rng(0)
    logit_checks(rng)
    centering_checks(rng)
    library_checks(rng)
    finish("centering")


if __name__ == "__main__":
    main()
