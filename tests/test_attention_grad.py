"""Gradients through the pure-JAX estimators: finite where the forward pass is, and equal to
central finite differences where the sampled set does not move.

Degenerate inputs that the forward pass handles by convention (a zero query, a zero centered
key, a cosine of exactly ±1: ``p`` is taken as 1/2, 1 or 0) once gave NaN gradients: the norm's
0/0 at a zero vector and arccos's infinite slope at ±1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magicpig_jax import lsh
from magicpig_jax.attention import (
    HybridConfig,
    MagicPIGConfig,
    build_lsh_index,
    dense_attention,
    hybrid_attention,
    magicpig_attention,
)

B, HQ, HKV, N, D = 1, 2, 1, 12, 8
CFG = MagicPIGConfig(K=1, L=4, num_sink=2, num_local=3)


def _arrays(seed: int = 0, d: int = D):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, HQ, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, HKV, N, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, HKV, N, d)), jnp.float32)
    return q, k, v


def _finite(tree) -> bool:
    return all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(tree))


ESTIMATORS = {
    "magicpig": lambda q, k, v, idx, lens: magicpig_attention(q, k, v, idx, CFG, lens)[0],
    "hybrid": lambda q, k, v, idx, lens: hybrid_attention(q, k, v, idx, HybridConfig(K=1, L=4, num_sink=2,
                                                                                      num_local=3, heavy=3), lens)[0],
}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_one_hashed_key_has_finite_gradients(name):
    # num_sink + num_local + 1 positions: the hashed range holds one key, so its centered key is 0
    q, k, v = _arrays()
    lens = jnp.array([CFG.num_sink + CFG.num_local + 1])
    proj = lsh.simhash_projections(jax.random.key(0), D, CFG.K, CFG.L)
    idx = build_lsh_index(k, proj, CFG, lens)
    fn = ESTIMATORS[name]
    assert _finite(fn(q, k, v, idx, lens))
    grads = jax.grad(lambda q, k, v: fn(q, k, v, idx, lens).sum(), argnums=(0, 1, 2))(q, k, v)
    assert _finite(grads)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_zero_query_head_has_finite_gradients(name):
    q, k, v = _arrays(1)
    q = q.at[0, 0].set(0.0)
    idx = build_lsh_index(k, lsh.simhash_projections(jax.random.key(1), D, CFG.K, CFG.L), CFG)
    fn = ESTIMATORS[name]
    grads = jax.grad(lambda q, k: fn(q, k, v, idx, None).sum(), argnums=(0, 1))(q, k)
    assert _finite(grads)


def test_parallel_vectors_have_finite_gradients():
    # D = 1: every cosine is exactly ±1 (arccos's slope is infinite there)
    q, k, v = _arrays(2, d=1)
    idx = build_lsh_index(k, lsh.simhash_projections(jax.random.key(2), 1, CFG.K, CFG.L), CFG)
    grads = jax.grad(lambda q, k, v: magicpig_attention(q, k, v, idx, CFG)[0].sum(), argnums=(0, 1, 2))(q, k, v)
    assert _finite(grads)


def test_collision_probability_at_the_edges():
    cos = jnp.array([1.0, -1.0, 1.5, -2.0, 0.5, jnp.nan], jnp.float32)
    p = lsh.collision_probability_from_cosine(cos)
    np.testing.assert_allclose(np.asarray(p[:5]), [1.0, 0.0, 1.0, 0.0, 1.0 - np.arccos(0.5) / np.pi], rtol=1e-6)
    assert np.isnan(np.asarray(p[5]))
    g = jax.grad(lambda c: lsh.collision_probability_from_cosine(c).sum())(cos[:5])
    np.testing.assert_allclose(np.asarray(g), [0.0, 0.0, 0.0, 0.0, 1.0 / (np.pi * np.sqrt(0.75))], rtol=1e-5)


@pytest.mark.parametrize("name", ["magicpig", "dense"])
def test_gradient_matches_central_differences(name):
    q, k, v = _arrays(3)
    idx = build_lsh_index(k, lsh.simhash_projections(jax.random.key(3), D, CFG.K, CFG.L), CFG)
    w = jnp.asarray(np.random.default_rng(4).normal(size=(B, HQ, D)), jnp.float32)

    def out(q):
        if name == "dense":
            return dense_attention(q, k, v)[0]
        return magicpig_attention(q, k, v, idx, CFG)[0]

    def loss(q):
        return (out(q) * w).sum()

    g = jax.grad(loss)(q)
    rng = np.random.default_rng(5)
    eps = 1e-2
    for _ in range(3):
        d = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
        if name == "magicpig":  # the difference is only a derivative while the sampled set stays put
            counts = [magicpig_attention(x, k, v, idx, CFG)[2] for x in (q, q + eps * d, q - eps * d)]
            assert all(bool((c == counts[0]).all()) for c in counts)
        q64, d64 = np.asarray(q, np.float64), np.asarray(d, np.float64)
        fd = (float(loss(jnp.asarray(q64 + eps * d64, jnp.float32))) -
              float(loss(jnp.asarray(q64 - eps * d64, jnp.float32)))) / (2 * eps)
        np.testing.assert_allclose(float((g * d).sum()), fd, rtol=2e-3, atol=2e-4)
