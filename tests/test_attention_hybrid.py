"""The hybrid LSH estimator (magicpig_jax.attention.hybrid) against float64 NumPy / SciPy: its light
probability u_c, its weights and output for given codes, the reduction to MagicPIG (heavy = L + 1),
unbiasedness of each key's term, and consistency as the number of hash draws grows."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import special, stats

from magicpig_jax import lsh
from magicpig_jax.attention import (
    HybridConfig,
    MagicPIGConfig,
    build_lsh_index,
    hybrid_attention,
    magicpig_attention,
)
from magicpig_jax.attention.hybrid import hybrid_log_weights, log_light_probability
from tests import _np_reference as np_ref

pytestmark = pytest.mark.usefixtures("strict_jax")


def log_uc_ref(p, K, L, m):
    """float64 log P[X >= 2 | X < m], X ~ Binomial(L, p^K), from SciPy's log pmf."""
    P = np.asarray(p, np.float64) ** K
    j = np.arange(m)
    with np.errstate(all="ignore"):
        lp = stats.binom.logpmf(j[None, :], L, P[:, None])
        return special.logsumexp(lp[:, 2:], axis=1) - special.logsumexp(lp, axis=1)


@settings(max_examples=min(20, settings.default.max_examples))  # fewer than the default 100 (CI time)
@given(st.integers(1, 16), st.integers(2, 400), st.data())
def test_light_probability_matches_scipy(K, L, data):
    m = data.draw(st.integers(3, L + 1))
    p = np.linspace(0.0, 1.0, 257)
    got = np.asarray(log_light_probability(jnp.asarray(p, jnp.float32), K, L, m), np.float64)
    ref = log_uc_ref(p.astype(np.float32), K, L, m)
    ok = np.isfinite(ref) & (ref > -60)
    np.testing.assert_allclose(np.exp(got[ok] - ref[ok]), 1.0, rtol=2e-5)
    assert np.all(got[p == 0] == -np.inf) and not np.any(np.isnan(got))


def test_light_probability_is_u_when_nothing_is_heavy():
    p = jnp.linspace(0.01, 1.0, 200, dtype=jnp.float32)
    for K, L in ((4, 10), (10, 150)):
        np.testing.assert_allclose(np.asarray(log_light_probability(p, K, L, L + 1)),
                                   np.asarray(lsh.log_sampling_probability(p, K, L)), atol=2e-5, rtol=2e-5)


def test_config_validation():
    assert HybridConfig(K=4, L=10, heavy=11).heavy == 11
    for bad in (2, 12):
        with pytest.raises(ValueError, match="heavy"):
            HybridConfig(K=4, L=10, heavy=bad)
    with pytest.raises(TypeError, match="HybridConfig"):
        hybrid_attention(jnp.zeros((1, 1, 4)), jnp.zeros((1, 1, 8, 4)), jnp.zeros((1, 1, 8, 4)),
                         build_lsh_index(jnp.zeros((1, 1, 8, 4)), jnp.ones((4, 8)), MagicPIGConfig(K=4, L=2)),
                         MagicPIGConfig(K=4, L=2))


def _case(seed, B=2, Hq=4, Hkv=2, N=96, D=8):
    rng = np.random.default_rng(seed)
    offset = 2.0 * rng.normal(size=(B, Hkv, 1, D))  # keys in a cone, as real keys
    k = rng.normal(size=(B, Hkv, N, D)) + offset
    q = 2.0 * rng.normal(size=(B, Hq, D))
    v = rng.normal(size=(B, Hkv, N, D)) + rng.normal(size=(B, Hkv, 1, D))
    return (jnp.asarray(x, jnp.float32) for x in (q, k, v))


def _np_codes(x, w, K, L):
    bits = ((x @ w) > 0).reshape(*x.shape[:-1], L, K).astype(np.int64)
    return np.sum(bits << np.arange(K), axis=-1)


def hybrid_ref(q, k, v, w, K, L, m, num_sink, num_local, cap=None):
    """float64: hybrid attention of every (row, head) from the codes of the projections ``w`` (logits
    soft-capped by ``cap`` before ``log u_c`` is subtracted)."""
    q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, w))
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    start, end = min(num_sink, N), max(N - num_local, min(num_sink, N))
    out, lse, num = np.zeros((B, Hq, D)), np.zeros((B, Hq)), np.zeros((B, Hq), int)
    for b in range(B):
        for h in range(Hq):
            kk, vv = k[b, h // G], v[b, h // G]
            mean = kk[start:end].mean(0)
            kc = kk - mean
            hits = (_np_codes(kc, w, K, L) == _np_codes(q[b, h], w, K, L)[None, :]).sum(-1)
            cos = kc @ q[b, h] / (np.linalg.norm(kc, axis=-1) * np.linalg.norm(q[b, h]))
            p = 1 - np.arccos(np.clip(cos, -1, 1)) / math.pi
            log_w = np.where(hits >= m, 0.0, np.maximum(log_uc_ref(p, K, L, m), np_ref.LOG_U_FLOOR))
            pos = np.arange(N)
            hashed = (pos >= start) & (pos < end)
            sampled = hashed & (hits >= 2)
            logits = np_ref.softcap(kk @ q[b, h] / math.sqrt(D), cap) - np.where(sampled, log_w, 0.0)
            out[b, h], lse[b, h] = np_ref.softmax_over(logits, sampled | ~hashed, vv)
            num[b, h] = sampled.sum()
    return out, lse, num


@settings(max_examples=25)
@given(st.integers(0, 2**31 - 1), st.sampled_from([(3, 8, 3), (3, 8, 5), (4, 20, 9), (2, 6, 7)]),
       st.sampled_from([None, 0.5, 3.0]))
def test_matches_float64_reference(seed, klm, cap):
    K, L, m = klm
    q, k, v = _case(seed)
    cfg = HybridConfig(K=K, L=L, heavy=m, num_sink=2, num_local=8)
    w = lsh.simhash_projections(jax.random.key(seed % 1000), 8, K, L)
    out, lse, num = hybrid_attention(q, k, v, build_lsh_index(k, w, cfg), cfg, softcap=cap)
    r_out, r_lse, r_num = hybrid_ref(q, k, v, w, K, L, m, 2, 8, cap)
    np.testing.assert_array_equal(np.asarray(num), r_num)
    np.testing.assert_allclose(np.asarray(out), r_out, atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(np.asarray(lse), r_lse, atol=2e-4, rtol=1e-4)


def test_nothing_heavy_is_magicpig():
    q, k, v = _case(7)
    base = MagicPIGConfig(K=4, L=20, num_sink=2, num_local=8)
    cfg = HybridConfig(K=4, L=20, heavy=21, num_sink=2, num_local=8)
    w = lsh.simhash_projections(jax.random.key(3), 8, 4, 20)
    idx = build_lsh_index(k, w, base)
    h_out, h_lse, h_num = hybrid_attention(q, k, v, idx, cfg)
    m_out, m_lse, m_num = magicpig_attention(q, k, v, idx, base)
    np.testing.assert_array_equal(np.asarray(h_num), np.asarray(m_num))
    np.testing.assert_allclose(np.asarray(h_out), np.asarray(m_out), atol=1e-5)
    np.testing.assert_allclose(np.asarray(h_lse), np.asarray(m_lse), atol=1e-5)


@settings(max_examples=min(20, settings.default.max_examples))  # fewer than the default 100 (CI time)
@given(st.integers(1, 8), st.integers(3, 30), st.data())
def test_each_key_term_is_unbiased(K, L, data):
    """E[1{X >= m} + 1{2 <= X < m} / u_c] = 1 for X ~ Binomial(L, p^K) (exact enumeration, float64)."""
    m = data.draw(st.integers(3, L + 1))
    p = np.asarray(data.draw(st.lists(st.floats(0.05, 0.999), min_size=1, max_size=8)), np.float32)
    log_w = np.asarray(hybrid_log_weights(jnp.zeros(p.shape, jnp.int32), jnp.asarray(p), K, L, m), np.float64)
    x = np.arange(L + 1)
    pmf = stats.binom.pmf(x[None, :], L, (p.astype(np.float64) ** K)[:, None])
    term = np.where(x >= m, 1.0, np.where(x >= 2, np.exp(-log_w)[:, None], 0.0))
    np.testing.assert_allclose((pmf * term).sum(1), 1.0, rtol=5e-5)


_attend = jax.jit(hybrid_attention, static_argnames="config")
_build = jax.jit(build_lsh_index, static_argnames="config")


@settings(max_examples=6)
@given(st.integers(0, 2**31 - 1), st.sampled_from([(3, 6, 3), (4, 12, 4), (3, 10, 6)]))
def test_consistent_as_the_hash_draws_grow(seed, klm):
    """Pooling R independent hash draws (the LSE merge of R estimates) converges to dense attention:
    within 5 estimated standard errors at R = 400, and the error shrinks from R = 25 to R = 400."""
    K, L, m = klm
    q, k, v = _case(seed, B=1, Hq=2, Hkv=1, N=48, D=8)
    cfg = HybridConfig(K=K, L=L, heavy=m, num_sink=0, num_local=0)  # every key sampled: no exact part
    dense, _ = np_ref.dense(q, k, v)
    outs, lses = [], []
    for r in range(400):
        w = lsh.simhash_projections(jax.random.key(seed % 10_000 * 1000 + r), 8, K, L)
        o, lse, _ = _attend(q, k, v, _build(k, w, cfg), cfg)
        outs.append(np.asarray(o, np.float64))
        lses.append(np.asarray(lse, np.float64))
    outs, lses = np.stack(outs), np.stack(lses)  # [R, 1, Hq, D], [R, 1, Hq]
    z = np.where(np.isfinite(lses), np.exp(lses - np.nanmax(np.where(np.isfinite(lses), lses, np.nan), 0)), 0.0)

    def pooled(R):
        zr = z[:R]
        return (zr[..., None] * outs[:R]).sum(0) / np.maximum(zr.sum(0)[..., None], 1e-300)

    err = {R: np.linalg.norm(pooled(R) - dense, axis=-1) for R in (25, 400)}
    # delta method: the per-draw terms z_r (o_r - dense), over their mean weight
    resid = z[..., None] * (outs - dense[None])
    se = np.sqrt((resid ** 2).sum(-1).mean(0) / 400) / np.maximum(z.mean(0), 1e-300)
    assert np.all(err[400] <= 5 * se + 1e-6), (err[400], se)
    assert float(err[400].mean()) < float(err[25].mean()) + 1e-6
