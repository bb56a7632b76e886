"""Property tests (hypothesis) and edge cases of the attention estimators and SimHash.

Shapes are fixed per test (hypothesis draws seeds, scales, budgets and (K, L)
from small sets) so that each jitted function compiles a handful of times;
statistical checks use stated bounds (CLT at z = 6, exact binomial tests at
p-value 1e-6) and the hypothesis profile is derandomized (tests/conftest.py).
"""

from __future__ import annotations

import math

import _np_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from magicpig_jax import lsh
from magicpig_jax.attention import (
    MagicPIGConfig,
    oracle_sampling_attention,
)

pytestmark = pytest.mark.usefixtures("strict_jax")

from tests._jitted import (  # noqa: E402
    build_j,
    dense_j,
    i32,
    magicpig_j,
    make_qkv,
    merge_j,
    oracle_j,
    quest_j,
    topk_j,
)

seeds = st.integers(0, 2**31 - 1)
Z = 6.0  # CLT bound: P(|N(0,1)| > 6) = 2e-9 per coordinate


def rand_qkv(seed, D=8, **kwargs):
    """Random q, k, v with head dim 8 by default (see :func:`tests._jitted.make_qkv`)."""
    return make_qkv(seed, D=D, **kwargs)


def finite_or_empty(out, lse):
    """Never NaN: out finite, lse finite or -inf."""
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.all(np.isfinite(out))
    assert not np.any(np.isnan(lse)) and not np.any(lse == np.inf)


def magicpig_ref(q, k, v, index, cfg, build_lengths, lengths):
    qcodes = np.asarray(lsh.simhash_codes(q, index.projections, cfg.K, cfg.L))
    return ref.magicpig(
        q, k, v, np.asarray(index.codes), qcodes, cfg.K, cfg.L, cfg.num_sink, cfg.num_local,
        np.asarray(build_lengths), np.asarray(lengths),
    )


def make_index(k, cfg, lengths=None, seed=0):
    proj = lsh.simhash_projections(jax.random.key(seed), k.shape[-1], cfg.K, cfg.L)
    return build_j(k, proj, cfg, lengths)


# ----------------------------------------------------------------------------- oracle sampling


@jax.jit
def _oracle_many(keys, q, k, v, lengths):
    return jax.vmap(lambda r: oracle_sampling_attention(r, q, k, v, 8, lengths))(keys)


@settings(max_examples=12)
@given(seed=seeds, scale=st.sampled_from([0.5, 2.0, 4.0]))
def test_oracle_sampling_mean_converges_to_dense(seed, scale):
    """Theorem 3.2: E[oracle] = o and Cov = (sum_i w_i v_i v_i^T - o o^T) / n (n = 8 draws)."""
    S, n = 512, 8
    q, k, v = rand_qkv(seed, N=24, scale=scale)
    lengths = i32([24, 1 + seed % 24])
    outs, lse, distinct = _oracle_many(jax.random.split(jax.random.key(seed), S), q, k, v, lengths)
    outs = np.asarray(outs, np.float64)
    r_out, r_lse = ref.dense(q, k, v, np.asarray(lengths))
    # Per-coordinate variance of one draw, from the exact weights (float64).
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    var = np.zeros_like(r_out)
    exp_distinct = np.zeros(r_lse.shape)
    for b in range(2):
        m = int(lengths[b])
        for h in range(4):
            logits = kn[b, h // 2, :m] @ qn[b, h] / math.sqrt(8)
            w = np.exp(logits - logits.max())
            w /= w.sum()
            var[b, h] = w @ vn[b, h // 2, :m] ** 2 - r_out[b, h] ** 2
            exp_distinct[b, h] = np.sum(1 - (1 - w) ** n)
            # Theorem 3.3: E[distinct] <= 1 + n (1 - max w).
            assert exp_distinct[b, h] <= 1 + n * (1 - w.max()) + 1e-12
    mean = outs.mean(0)
    bound = Z * np.sqrt(np.maximum(var, 0) / (S * n)) + 1e-5
    assert np.all(np.abs(mean - r_out) <= bound), np.max(np.abs(mean - r_out) / bound)
    # Trace of the covariance of one estimate: (sum_d var_d) / n, within a loose chi-square-type band.
    tr_emp = outs.var(0, ddof=1).sum(-1)
    tr_theory = var.sum(-1) / n
    big = tr_theory > 1e-3
    assert np.all(np.abs(tr_emp[big] / tr_theory[big] - 1) < 0.5)
    # lse is the exact LSE; distinct counts average to sum_i 1 - (1 - w_i)^n.
    np.testing.assert_allclose(np.asarray(lse)[0], r_lse, rtol=1e-5, atol=1e-5)
    d = np.asarray(distinct, np.float64)
    sd = np.sqrt(np.maximum(d.var(0), 1 / S))
    assert np.all(np.abs(d.mean(0) - exp_distinct) <= Z * sd / math.sqrt(S) + 1e-9)
    assert np.all(d <= np.minimum(n, np.asarray(lengths)[:, None]))


def test_oracle_sampling_covariance_decreases_with_budget():
    q, k, v = rand_qkv(3, N=24, scale=2.0)
    keys = jax.random.split(jax.random.key(0), 400)
    traces = []
    for n in (1, 4, 16):
        f = jax.jit(jax.vmap(lambda r, n=n: oracle_sampling_attention(r, q, k, v, n)[0]))
        traces.append(np.asarray(f(keys), np.float64).var(0, ddof=1).sum(-1))
    # Theory: trace ~ c / n; each 4x budget step must cut it by well over 2x.
    assert np.all(traces[1] < traces[0] / 2) and np.all(traces[2] < traces[1] / 2)


# ----------------------------------------------------------------------------- SimHash collision frequency


def _sampled_frequency(key, x, K, L, R, D):
    """Over R independent projection draws: per-bit same-bit, per-table equal, and >= 2-table counts."""

    def one(r):
        w = lsh.simhash_projections(r, D, K, L)
        c = lsh.simhash_codes(x, w, K, L)  # [2, L]
        bits = (x @ w > 0).astype(jnp.int32)  # [2, K*L]
        same_bits = jnp.sum(bits[0] == bits[1])
        eq = c[0] == c[1]
        return same_bits, jnp.sum(eq), jnp.sum(eq) >= 2

    same, tables, sampled = jax.vmap(one)(jax.random.split(key, R))
    return jnp.sum(same), jnp.sum(tables), jnp.sum(sampled)


_freq = jax.jit(_sampled_frequency, static_argnames=("K", "L", "R", "D"))


@settings(max_examples=8)
@given(
    seed=seeds,
    K=st.sampled_from([1, 3, 10, 32]),
    L=st.sampled_from([2, 10, 150]),
    log_target=st.floats(math.log(1e-3), math.log(0.9)),
)
def test_simhash_collision_frequency_matches_sampling_probability(seed, K, L, log_target):
    """P[same bit] = p, P[table equal] = p^K, P[>= 2 tables] = u (exact binomial tests, p-value 1e-6)."""
    D, R = 8, 2000
    # Pick the angle so that p^K = target; build q, k at that angle in a random plane.
    p_target = math.exp(log_target / K)
    theta = math.pi * (1 - p_target)
    rng = np.random.default_rng(seed)
    basis, _ = np.linalg.qr(rng.normal(size=(D, 2)))
    q = basis[:, 0] * rng.uniform(0.5, 50)
    k = (math.cos(theta) * basis[:, 0] + math.sin(theta) * basis[:, 1]) * rng.uniform(0.5, 50)
    x = jnp.asarray(np.stack([q, k]), jnp.float32)
    p = lsh.collision_probability(x[0], x[1])
    u = float(lsh.sampling_probability(p, K, L))
    p = float(p)
    same, tables, sampled = (int(t) for t in _freq(jax.random.key(seed), x, K=K, L=L, R=R, D=D))
    assert stats.binomtest(same, R * K * L, p).pvalue > 1e-6, (same / (R * K * L), p)
    assert stats.binomtest(tables, R * L, p**K).pvalue > 1e-6, (tables / (R * L), p**K)
    assert stats.binomtest(sampled, R, u).pvalue > 1e-6, (sampled / R, u)


# ----------------------------------------------------------------------------- centering invariance


@settings(max_examples=10)
@given(seed=seeds, shift=st.integers(-40, 40))
def test_centering_invariance(seed, shift):
    """Adding one vector c to every key changes no code, no sample, no output; lse moves by q·c/sqrt(D).

    Integer data, D = 16 and 16 hashed keys make k + c, the mean and k - mean exact in float32.
    """
    rng = np.random.default_rng(seed)
    B, Hq, Hkv, N, D = 2, 4, 2, 20, 16
    cfg = MagicPIGConfig(K=3, L=8, num_sink=2, num_local=2)
    q = jnp.asarray(rng.integers(-3, 4, (B, Hq, D)), jnp.float32)
    k = jnp.asarray(rng.integers(-8, 9, (B, Hkv, N, D)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, Hkv, N, D)), jnp.float32)
    c = jnp.asarray(rng.integers(-3, 4, (B, Hkv, 1, D)) * shift, jnp.float32)
    idx0, idx1 = make_index(k, cfg, seed=seed), make_index(k + c, cfg, seed=seed)
    np.testing.assert_array_equal(idx0.codes, idx1.codes)
    o0, l0, n0 = magicpig_j(q, k, v, idx0, cfg)
    o1, l1, n1 = magicpig_j(q, k + c, v, idx1, cfg)
    np.testing.assert_array_equal(n0, n1)
    shift_lse = np.einsum("bhgd,bhd->bhg", np.asarray(q).reshape(B, Hkv, 2, D), np.asarray(c)[:, :, 0]) / 4.0
    np.testing.assert_allclose(o1, o0, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(l1, np.asarray(l0) + shift_lse.reshape(B, Hq), rtol=1e-5, atol=1e-3)
    d0, dl0 = dense_j(q, k, v)
    d1, dl1 = dense_j(q, k + c, v)
    np.testing.assert_allclose(d1, d0, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dl1, np.asarray(dl0) + shift_lse.reshape(B, Hq), rtol=1e-5, atol=1e-3)


def test_centering_a_non_constant_shift_changes_the_output():
    """The converse: shifting keys differently changes the softmax (so centering must shift every key)."""
    q, k, v = rand_qkv(1)
    k2 = k.at[:, :, :12].add(q.reshape(2, 2, 2, 8)[:, :, :1] * 0.5)  # only half of the keys
    assert not np.allclose(dense_j(q, k, v)[0], dense_j(q, k2, v)[0], atol=1e-3)


# ----------------------------------------------------------------------------- merge associativity


@settings(max_examples=15)
@given(seed=seeds, cuts=st.tuples(st.integers(0, 30), st.integers(0, 30)), scale=st.sampled_from([1.0, 10.0]))
def test_merge_associative_and_exact(seed, cuts, scale):
    N = 30
    q, k, v = rand_qkv(seed, N=N, scale=scale)
    perm = np.random.default_rng(seed).permutation(N)
    kp, vp = np.asarray(k)[:, :, perm], np.asarray(v)[:, :, perm]
    a, b = sorted(cuts)
    parts = []
    for start, size in ((0, a), (a, b - a), (b, N - b)):  # three disjoint ranges, possibly empty
        kr, vr = np.roll(kp, -start, axis=2), np.roll(vp, -start, axis=2)
        parts.append(dense_j(q, jnp.asarray(kr), jnp.asarray(vr), i32([size, size])))
    (oa, la), (ob, lb), (oc, lc) = parts
    left = merge_j(*merge_j(oa, la, ob, lb), oc, lc)
    right = merge_j(oa, la, *merge_j(ob, lb, oc, lc))
    swapped = merge_j(*merge_j(oa, la, oc, lc), ob, lb)
    r_out, r_lse = ref.dense(q, k, v)
    for o, lse in (left, right, swapped):
        np.testing.assert_allclose(o, r_out, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lse, r_lse, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(left[0], right[0], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- GQA mapping and batch rows


ALL_CFG = MagicPIGConfig(K=4, L=10, num_sink=2, num_local=3)


def _all_estimators(q, k, v, lengths, cfg=ALL_CFG):
    """Every estimator on the same inputs; MagicPIG's index uses fixed projections (seed 0)."""
    idx = make_index(k, cfg, lengths)
    return {
        "dense": dense_j(q, k, v, lengths),
        "topk": topk_j(q, k, v, 5, lengths),
        "quest": quest_j(q, k, v, 4, 0.3, lengths),
        "oracle": oracle_j(jax.random.key(7), q, k, v, 6, lengths),
        "magicpig": magicpig_j(q, k, v, idx, cfg, lengths),
    }


@settings(max_examples=6)
@given(seed=seeds)
def test_gqa_mapping_equals_repeated_kv_heads(seed):
    """Query head h reads KV head h // G: GQA equals MHA with each KV head repeated G times."""
    Hkv, G = 2, 2
    q, k, v = rand_qkv(seed, Hq=Hkv * G, Hkv=Hkv, N=24, cone=2.0)
    lengths = i32([24, 1 + seed % 24])
    gqa = _all_estimators(q, k, v, lengths)
    mha = _all_estimators(q, jnp.repeat(k, G, axis=1), jnp.repeat(v, G, axis=1), lengths)
    for name in gqa:
        for a, b in zip(gqa[name], mha[name], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
    # And head h really reads KV head h // G (not h % Hkv): compare with a one-KV-head call.
    for h in range(Hkv * G):
        one = dense_j(q[:, h : h + 1], k[:, h // G : h // G + 1], v[:, h // G : h // G + 1], lengths)
        np.testing.assert_allclose(gqa["dense"][0][:, h], one[0][:, 0], rtol=1e-6, atol=1e-6)


@settings(max_examples=6)
@given(seed=seeds, other=seeds)
def test_batch_rows_are_independent(seed, other):
    q, k, v = rand_qkv(seed, N=24, cone=2.0)
    q2, k2, v2 = rand_qkv(other, N=24, scale=3.0, cone=5.0)
    lengths = i32([17, 24])
    # Replace row 1 by unrelated data and another length; row 0 must not move.
    qm, km, vm = q.at[1].set(q2[1]), k.at[1].set(k2[1]), v.at[1].set(v2[1])
    base = _all_estimators(q, k, v, lengths)
    mixed = _all_estimators(qm, km, vm, i32([17, 3 + other % 20]))
    for name in base:
        for a, b in zip(base[name], mixed[name], strict=True):
            np.testing.assert_allclose(np.asarray(a)[0], np.asarray(b)[0], rtol=1e-6, atol=1e-6, err_msg=name)


# ----------------------------------------------------------------------------- edge cases


def test_edge_no_keys():
    """N = 0 (and lengths 0): out = 0, lse = -inf, nothing counted, for every estimator."""
    for N, lengths in ((0, None), (6, i32([0, 0]))):
        q, k, v = rand_qkv(0, N=N)
        res = _all_estimators(q, k, v, lengths)
        for name, r in res.items():
            np.testing.assert_array_equal(r[0], 0.0, err_msg=name)
            assert np.all(np.isneginf(r[1])), name
            if len(r) == 3:
                np.testing.assert_array_equal(r[2], 0, err_msg=name)


def test_edge_one_key():
    """N = 1: out = v_0 and lse = q·k_0/sqrt(D) (the key is static under the default sinks)."""
    q, k, v = rand_qkv(1, N=1)
    want_out = np.asarray(v)[:, [0, 0, 1, 1], 0]
    want_lse = np.einsum("bhd,bhd->bh", np.asarray(q, np.float64), np.asarray(k, np.float64)[:, [0, 0, 1, 1], 0])
    want_lse /= math.sqrt(8)
    for name, r in _all_estimators(q, k, v, None).items():
        np.testing.assert_allclose(r[0], want_out, rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(r[1], want_lse, rtol=1e-5, atol=1e-6, err_msg=name)
    # One hashed key (no static set): it is its own mean, so its centered key is 0 (code 0,
    # p = 1/2 by convention). Sampled -> out = v_0, lse = logit - log u(1/2); else 0, -inf.
    cfg = MagicPIGConfig(K=1, L=3, num_sink=0, num_local=0)
    out, lse, num = magicpig_j(q, k, v, make_index(k, cfg), cfg)
    log_u = float(lsh.log_sampling_probability(jnp.float32(0.5), 1, 3))
    num = np.asarray(num)
    assert set(np.unique(num)) <= {0, 1} and num.sum() > 0
    np.testing.assert_allclose(np.asarray(out)[num == 1], want_out[num == 1], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse)[num == 1], want_lse[num == 1] - log_u, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out)[num == 0], 0.0)
    assert np.all(np.isneginf(np.asarray(lse)[num == 0]))


@settings(max_examples=6)
@given(seed=seeds, n=st.integers(0, 12))
def test_edge_all_keys_static(seed, n):
    """N <= num_sink + num_local: MagicPIG is dense attention exactly."""
    cfg = MagicPIGConfig(K=4, L=10, num_sink=4, num_local=8)
    q, k, v = rand_qkv(seed, N=12, cone=3.0)
    lengths = i32([n, 12])
    out, lse, num = magicpig_j(q, k, v, make_index(k, cfg, lengths), cfg, lengths)
    d_out, d_lse = dense_j(q, k, v, lengths)
    np.testing.assert_allclose(out, d_out, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(lse, d_lse, rtol=1e-6)
    np.testing.assert_array_equal(num, 0)


def test_edge_nothing_can_be_sampled():
    """K = 32, L = 2: u <= p^64 ~ 1e-7 even at cos 0.7, so no key is sampled: the static part alone."""
    q, k, v = rand_qkv(2, N=30, D=16)
    for sinks, local in ((3, 4), (0, 0)):
        cfg = MagicPIGConfig(K=32, L=2, num_sink=sinks, num_local=local)
        out, lse, num = magicpig_j(q, k, v, make_index(k, cfg), cfg)
        np.testing.assert_array_equal(num, 0)
        keep = np.zeros((2, 4, 30), bool)
        keep[:, :, :sinks] = True
        keep[:, :, 30 - local :] = True
        r_out, r_lse = ref.selected(q, k, v, keep)
        np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-6)
        if sinks:
            np.testing.assert_allclose(lse, r_lse, rtol=1e-5)
        else:  # nothing at all: the empty-set convention, never NaN
            np.testing.assert_array_equal(out, 0.0)
            assert np.all(np.isneginf(lse))


def test_edge_zero_query():
    """q = 0: every logit is 0. Dense/oracle: mean of v, lse = log n; TopK/Quest: ties -> first keys;
    MagicPIG: the query code is 0 in every table (zero-projection convention) and cos = 0, so p = 1/2."""
    q, k, v = rand_qkv(3, N=24, cone=2.0)
    q = jnp.zeros_like(q)
    lengths = i32([24, 10])
    res = _all_estimators(q, k, v, lengths)
    vn = np.asarray(v, np.float64)[:, [0, 0, 1, 1]]
    mean_v = np.stack([vn[0, :, :24].mean(1), vn[1, :, :10].mean(1)])
    np.testing.assert_allclose(res["dense"][0], mean_v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res["dense"][1], np.log([[24] * 4, [10] * 4]), rtol=1e-6)
    np.testing.assert_allclose(res["topk"][0], vn[:, :, :5].mean(2), rtol=1e-5, atol=1e-6)
    # Quest, 0.3 of (24, 10) = (8, 3) tokens: 2 pages of 4, resp. 1 page -> the first ones.
    np.testing.assert_allclose(res["quest"][0], np.stack([vn[0, :, :8].mean(1), vn[1, :, :4].mean(1)]), rtol=1e-5)
    np.testing.assert_allclose(res["oracle"][1], res["dense"][1], rtol=1e-6)
    cfg = MagicPIGConfig(K=4, L=10, num_sink=2, num_local=3)
    idx = make_index(k, cfg, lengths)
    np.testing.assert_array_equal(lsh.simhash_codes(q, idx.projections, 4, 10), 0)
    r_out, r_lse, r_num = magicpig_ref(q, k, v, idx, cfg, lengths, lengths)
    np.testing.assert_array_equal(res["magicpig"][2], r_num)
    np.testing.assert_allclose(res["magicpig"][0], r_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res["magicpig"][1], r_lse, rtol=1e-5, atol=1e-6)
    for r in res.values():
        finite_or_empty(r[0], r[1])


def test_edge_key_equal_to_mean_and_parallel_key():
    """A hashed key equal to the mean (centered key exactly 0: code 0, cos = 0 by convention, so
    p = 1/2) and one parallel to the query after centering (cosine rounds to ~1 and is clamped:
    p ~ 1, u ~ 1): the float64 estimator's values. Integer data keep the mean exact, so the
    centered key is exactly 0 (a mean that is only equal up to rounding has no direction)."""
    B, Hq, Hkv, N, D = 1, 2, 1, 12, 8
    cfg = MagicPIGConfig(K=2, L=6, num_sink=2, num_local=2)
    rng = np.random.default_rng(4)
    q = rng.integers(-3, 4, size=(B, Hq, D)).astype(np.float64)
    m = rng.integers(-10, 11, size=D).astype(np.float64)
    a = rng.integers(-5, 6, size=(2, D)).astype(np.float64)
    # Hashed range 2..9 (8 keys) sums to 8 m: the mean is m exactly (in float32 as well).
    hashed = np.stack([m, m + 3 * q[0, 0], m - 3 * q[0, 0], m + a[0], m - a[0], m + a[1], m - a[1], m])
    k = np.concatenate([rng.normal(size=(2, D)), hashed, rng.normal(size=(2, D))])[None, None]
    v = rng.normal(size=(B, Hkv, N, D))
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    idx = make_index(k, cfg)
    np.testing.assert_array_equal(idx.mean[0, 0], m)
    np.testing.assert_array_equal(idx.codes[0, 0, 2], 0)  # centered key 0 -> code 0 in every table
    np.testing.assert_array_equal(idx.codes[0, 0, 9], 0)
    p = lsh.collision_probability(q[0, 0], k[0, 0, 3] - idx.mean[0, 0])
    assert float(p) >= 1 - 2e-4
    out, lse, num = magicpig_j(q, k, v, idx, cfg)
    r_out, r_lse, r_num = magicpig_ref(q, k, v, idx, cfg, [N], [N])
    np.testing.assert_array_equal(num, r_num)
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-5, atol=1e-5)
    finite_or_empty(out, lse)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_edge_half_precision_large_norms(dtype):
    """bf16/f16 inputs with norms ~100-300: finite, and equal to the float32 computation on the
    same (upcast) values, for every estimator."""
    q, k, v = rand_qkv(5, N=24, scale=40.0, cone=1.0, dtype=dtype)  # |q|, |k| ~ 110
    assert 80 < float(jnp.linalg.norm(q.astype(jnp.float32), axis=-1).mean()) < 300
    lengths = i32([24, 13])
    half = _all_estimators(q, k, v, lengths)
    full = _all_estimators(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), lengths)
    for name in half:
        finite_or_empty(half[name][0], half[name][1])
        for a, b in zip(half[name], full[name], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    r_out, r_lse = ref.dense(q, k, v, np.asarray(lengths))
    np.testing.assert_allclose(half["dense"][0], r_out, rtol=1e-4, atol=1e-4)


def test_edge_k32_magicpig_and_large_logits():
    """K = 32 end to end (uint32 codes use bit 31), with logits in the hundreds: the float64 estimator's value."""
    cfg = MagicPIGConfig(K=32, L=4, num_sink=1, num_local=1)
    q, k, v = rand_qkv(6, N=16, D=8, scale=6.0)
    # Make some keys nearly parallel to their query after centering so that sampling happens.
    k = k.at[:, :, 4:8].set(q.reshape(2, 2, 2, 8)[:, :, :1] * 3.0 + 0.01 * k[:, :, 4:8])
    idx = make_index(k, cfg)
    assert int(jnp.max(idx.codes)) >= 2**31
    out, lse, num = magicpig_j(q, k, v, idx, cfg)
    r_out, r_lse, r_num = magicpig_ref(q, k, v, idx, cfg, [16, 16], [16, 16])
    np.testing.assert_array_equal(num, r_num)
    assert r_num.sum() > 0
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-5, atol=1e-4)
    finite_or_empty(out, lse)


@settings(max_examples=8)
@given(seed=seeds, scale=st.sampled_from([0.1, 1.0, 30.0]), n=st.integers(0, 24))
def test_never_nan(seed, scale, n):
    q, k, v = rand_qkv(seed, N=24, scale=scale, cone=3.0)
    for name, r in _all_estimators(q, k, v, i32([n, 24 - n])).items():
        finite_or_empty(r[0], r[1])
        assert np.all(np.asarray(r[1])[0] == -np.inf) == (n == 0), name
