"""Attention estimators against independent float64 NumPy references (tests/_np_reference.py)."""

from __future__ import annotations

import fractions
import inspect
import math

import _np_reference as ref
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

from magicpig_jax import lsh
from magicpig_jax.attention import (
    MagicPIGConfig,
    budget_tokens,
    build_lsh_index,
    dense_attention,
    magicpig_attention,
    merge_attention,
    oracle_sampling_attention,
    quest_attention,
    topk_attention,
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

# ----------------------------------------------------------------------------- test harness


def test_runtime_shape_checking_is_active():
    q, k, v = make_qkv(0)
    # The jaxtyping hook rejects a q whose D disagrees with k's before the function body runs.
    with pytest.raises(jaxtyping.TypeCheckError):
        dense_attention(q[..., :8], k, v)
    with pytest.raises(jaxtyping.TypeCheckError):
        merge_attention(q, q[..., :2, 0], q, q[..., 0])
    assert inspect.unwrap(dense_attention) is not dense_attention


def test_strict_promotion_is_active():
    with pytest.raises(jax.dtypes.TypePromotionError):
        _ = jnp.ones(2, jnp.float32) + jnp.ones(2, jnp.int32)
    with pytest.raises(ValueError, match="rank_promotion"):
        _ = jnp.ones((2, 3)) + jnp.ones(3)


# ----------------------------------------------------------------------------- dense


@pytest.mark.parametrize("Hq,Hkv", [(1, 1), (4, 4), (4, 2), (6, 2), (8, 1)])
def test_dense_matches_float64(Hq, Hkv):
    q, k, v = make_qkv(Hq * 10 + Hkv, B=4, Hq=Hq, Hkv=Hkv, N=19, D=8, scale=2.0)
    lengths = i32([19, 7, 0, 1])
    out, lse = dense_j(q, k, v, lengths)
    assert out.shape == (4, Hq, 8) and lse.shape == (4, Hq)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    r_out, r_lse = ref.dense(q, k, v, np.asarray(lengths))
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse[:2], r_lse[:2], rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(out[2], 0.0)  # length 0: out = 0, lse = -inf
    assert np.all(np.isneginf(lse[2]))
    G = Hq // Hkv
    np.testing.assert_allclose(out[3], np.asarray(v)[3, np.arange(Hq) // G, 0], rtol=1e-6)  # one key


def test_dense_default_lengths_and_jit():
    q, k, v = make_qkv(1, N=11)
    out, lse = dense_j(q, k, v)
    r_out, r_lse = ref.dense(q, k, v)
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-6)
    j_out, j_lse = jax.jit(dense_attention)(q, k, v, i32([11, 3]))
    r_out, r_lse = ref.dense(q, k, v, [11, 3])
    np.testing.assert_allclose(j_out, r_out, rtol=1e-5, atol=1e-6)


def test_dense_lengths_clipped_and_large_logits():
    q, k, v = make_qkv(2, N=9, scale=30.0)  # logits in the hundreds: the max-shift must hold
    out, lse = dense_j(q, k, v, i32([100, -5]))
    r_out, r_lse = ref.dense(q, k, v, [9, 0])
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, r_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse[0], r_lse[0], rtol=1e-6)
    assert np.all(np.isneginf(lse[1]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dense_half_precision_inputs(dtype):
    q, k, v = make_qkv(3, scale=25.0, dtype=dtype)  # norms ~100
    out, lse = dense_j(q, k, v)
    assert out.dtype == jnp.float32
    r_out, r_lse = ref.dense(q, k, v)  # float64 of the same half-precision values
    np.testing.assert_allclose(out, r_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-6)


def test_dense_bad_inputs():
    q, k, v = make_qkv(4)
    raw = inspect.unwrap(dense_attention)  # the library's own checks, without the jaxtyping layer
    cases = [
        ((q[0], k, v), ValueError, "q must be"),
        ((q, k[0], v[0]), ValueError, "k and v"),
        ((q, k, v[:, :, :5]), ValueError, "same shape"),
        ((q[:1], k, v), ValueError, "disagree"),
        ((q[..., :8], k, v), ValueError, "disagree"),
        ((q[:, :3], k, v), ValueError, "multiple of Hkv"),
        ((q.astype(jnp.int32), k, v), TypeError, "q must be a floating"),
        ((q, k, v.astype(jnp.int32)), TypeError, "v must be a floating"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            raw(*args)
        with pytest.raises((exc, jaxtyping.TypeCheckError)):
            dense_j(*args)
    with pytest.raises(ValueError, match="lengths"):
        raw(q, k, v, i32([1, 2, 3]))
    with pytest.raises(TypeError, match="lengths"):
        raw(q, k, v, jnp.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="lengths"):
        dense_j(q, k, v, i32([1, 2, 3]))


# ----------------------------------------------------------------------------- merge


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merge_of_disjoint_parts_is_dense(seed):
    q, k, v = make_qkv(seed, B=2, Hq=6, Hkv=3, N=30, D=8, scale=2.0)
    perm = np.random.default_rng(seed).permutation(30)
    a, b = perm[:11], perm[11:]
    out_a, lse_a = dense_j(q, k[:, :, a], v[:, :, a])
    out_b, lse_b = dense_j(q, k[:, :, b], v[:, :, b])
    out, lse = merge_j(out_a, lse_a, out_b, lse_b)
    r_out, r_lse = ref.dense(q, k, v)
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-6)
    # Symmetric in its arguments.
    out2, lse2 = merge_j(out_b, lse_b, out_a, lse_a)
    np.testing.assert_allclose(out2, out, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(lse2, lse, rtol=1e-7)


def test_merge_empty_parts():
    q, k, v = make_qkv(5)
    out, lse = dense_j(q, k, v)
    empty_out = jnp.zeros_like(out)
    empty_lse = jnp.full(lse.shape, -jnp.inf)
    for args in [(out, lse, empty_out, empty_lse), (empty_out, empty_lse, out, lse)]:
        m_out, m_lse = merge_j(*args)
        np.testing.assert_array_equal(m_out, out)
        np.testing.assert_array_equal(m_lse, lse)
    m_out, m_lse = merge_j(empty_out, empty_lse, empty_out, empty_lse)
    np.testing.assert_array_equal(m_out, 0.0)
    assert np.all(np.isneginf(m_lse))
    # A part of length 0 from dense_attention itself merges the same way.
    z_out, z_lse = dense_j(q, k, v, i32([0, 0]))
    m_out, m_lse = merge_j(out, lse, z_out, z_lse)
    np.testing.assert_array_equal(m_out, out)


def test_merge_far_apart_lse_does_not_overflow():
    out_a = jnp.ones((1, 2, 3), jnp.float32)
    out_b = -jnp.ones((1, 2, 3), jnp.float32)
    lse_a = jnp.array([[1000.0, -1000.0]], jnp.float32)
    lse_b = jnp.array([[-1000.0, 1000.0]], jnp.float32)
    out, lse = merge_j(out_a, lse_a, out_b, lse_b)
    np.testing.assert_allclose(out, [[[1, 1, 1], [-1, -1, -1]]])
    np.testing.assert_allclose(lse, [[1000.0, 1000.0]])
    # Equal LSEs: the mean, and lse + log 2.
    out, lse = merge_j(out_a, lse_b * 0, out_b, lse_b * 0)
    np.testing.assert_allclose(out, 0.0, atol=1e-7)
    np.testing.assert_allclose(lse, math.log(2), rtol=1e-7)


def test_merge_bad_shapes():
    a = jnp.ones((2, 3, 4))
    raw = inspect.unwrap(merge_attention)
    with pytest.raises(ValueError, match="merge_attention"):
        raw(a, a[..., 0], a[:, :2], a[:, :2, 0])
    with pytest.raises(ValueError, match="merge_attention"):
        raw(a, a[..., :2, 0], a, a[..., :2, 0])
    with pytest.raises(jaxtyping.TypeCheckError):
        merge_j(a, a[..., :2, 0], a, a[..., :2, 0])


# ----------------------------------------------------------------------------- MagicPIG


def _index(k, cfg, lengths=None, seed=0):
    proj = lsh.simhash_projections(jax.random.key(seed), k.shape[-1], cfg.K, cfg.L)
    return build_j(k, proj, cfg, lengths)


@pytest.mark.parametrize("N,lengths", [(6, None), (12, [12, 3]), (12, [0, 12]), (1, None), (0, None)])
def test_magicpig_all_static_equals_dense(N, lengths):
    cfg = MagicPIGConfig(K=6, L=8, num_sink=4, num_local=8)
    q, k, v = make_qkv(6, N=N, cone=3.0)
    lengths = None if lengths is None else i32(lengths)
    index = _index(k, cfg, lengths)
    out, lse, num = magicpig_j(q, k, v, index, cfg, lengths)
    d_out, d_lse = dense_j(q, k, v, lengths)
    np.testing.assert_allclose(out, d_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, d_lse, rtol=1e-6)
    np.testing.assert_array_equal(num, 0)


@pytest.mark.parametrize(
    "K,L,num_sink,num_local,N,Hq,Hkv",
    [(4, 10, 2, 3, 40, 4, 2), (3, 6, 0, 0, 25, 3, 1), (10, 150, 4, 8, 64, 2, 2), (32, 2, 1, 1, 10, 2, 1)],
)
def test_magicpig_matches_float64_estimator(K, L, num_sink, num_local, N, Hq, Hkv):
    cfg = MagicPIGConfig(K=K, L=L, num_sink=num_sink, num_local=num_local)
    q, k, v = make_qkv(K + L + N, B=3, Hq=Hq, Hkv=Hkv, N=N, D=16, scale=1.5, cone=4.0)
    build = i32([N - 5, N, 6])
    lengths = i32([N, N, 5])  # row 0: 5 keys appended after the index was built (static)
    index = _index(k, cfg, build, seed=K)
    out, lse, num = magicpig_j(q, k, v, index, cfg, lengths)
    qcodes = np.asarray(lsh.simhash_codes(q, index.projections, K, L))
    r_out, r_lse, r_num = ref.magicpig(
        q, k, v, np.asarray(index.codes), qcodes, K, L, num_sink, num_local, np.asarray(build), np.asarray(lengths)
    )
    np.testing.assert_array_equal(num, r_num)
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-5, atol=1e-5)
    if (K, L) == (4, 10):
        assert 0 < r_num.sum() < np.sum(np.asarray(lengths)) * Hq  # exercised both paths


def test_magicpig_index_mean_and_range():
    cfg = MagicPIGConfig(K=4, L=4, num_sink=2, num_local=3)
    _, k, _ = make_qkv(7, N=20, cone=5.0)
    index = _index(k, cfg, i32([20, 4]))
    np.testing.assert_array_equal(index.start, [2, 2])
    np.testing.assert_array_equal(index.end, [17, 2])
    kn = np.asarray(k, np.float64)
    np.testing.assert_allclose(index.mean[0], kn[0, :, 2:17].mean(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(index.mean[1], 0.0)  # empty hashed range
    centered = np.asarray(k)[0, :, 2:17] - np.asarray(index.mean)[0][:, None]
    np.testing.assert_array_equal(
        index.codes[0, :, 2:17], lsh.simhash_codes(jnp.asarray(centered), index.projections, 4, 4)
    )


def test_magicpig_uncentered_index():
    cfg = MagicPIGConfig(K=4, L=10, num_sink=2, num_local=3)
    q, k, v = make_qkv(21, N=40, cone=3.0)
    proj = lsh.simhash_projections(jax.random.key(1), 16, 4, 10)
    index = jax.jit(build_lsh_index, static_argnames=("config", "center"))(k, proj, cfg, center=False)
    np.testing.assert_array_equal(index.mean, 0.0)
    np.testing.assert_array_equal(index.codes, lsh.simhash_codes(k, proj, 4, 10))
    out, lse, num = magicpig_j(q, k, v, index, cfg)
    qcodes = np.asarray(lsh.simhash_codes(q, proj, 4, 10))
    r_out, r_lse, r_num = ref.magicpig(
        q, k, v, np.asarray(index.codes), qcodes, 4, 10, 2, 3, [40, 40], [40, 40], center=False
    )
    np.testing.assert_array_equal(num, r_num)
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="center"):
        inspect.unwrap(build_lsh_index)(k, proj, cfg, center=1)


def test_magicpig_jit_and_pytree():
    cfg = MagicPIGConfig(K=4, L=10, num_sink=1, num_local=2)
    q, k, v = make_qkv(8, N=30)
    index = _index(k, cfg)
    jitted = magicpig_j(q, k, v, index, cfg)
    flat, treedef = jax.tree_util.tree_flatten(index)
    again = magicpig_j(q, k, v, jax.tree_util.tree_unflatten(treedef, flat), cfg)  # pytree round trip
    for a, b in zip(jitted, again, strict=True):
        np.testing.assert_array_equal(a, b)
    leaves = jax.tree_util.tree_leaves(index)
    assert len(leaves) == 5


def test_magicpig_bad_inputs():
    cfg = MagicPIGConfig(K=4, L=10)
    q, k, v = make_qkv(9, N=30)
    index = _index(k, cfg)
    raw = inspect.unwrap(magicpig_attention)
    with pytest.raises(ValueError, match="index.codes"):
        raw(q, k, v, index, MagicPIGConfig(K=4, L=12))
    with pytest.raises(ValueError, match="index.codes"):
        raw(q, k[:, :, :20], v[:, :, :20], index, cfg)
    with pytest.raises(ValueError, match="Hkv"):
        raw(q[:, :3], k, v, index, cfg)
    raw_build = inspect.unwrap(build_lsh_index)
    with pytest.raises(ValueError, match="projections"):
        raw_build(k, index.projections[:, :-1], cfg)
    with pytest.raises(ValueError, match="k must be"):
        raw_build(k[0], index.projections, cfg)
    with pytest.raises(TypeError, match="config"):
        raw_build(k, index.projections, {"K": 4, "L": 10})


@pytest.mark.parametrize(
    "kwargs,exc,field",
    [
        ({"K": 0}, ValueError, "K"),
        ({"K": 33}, ValueError, "K"),
        ({"K": 4.0}, TypeError, "K"),
        ({"L": 1}, ValueError, "L"),
        ({"L": True}, TypeError, "L"),
        ({"num_sink": -1}, ValueError, "num_sink"),
        ({"num_sink": 1.5}, TypeError, "num_sink"),
        ({"num_local": -2}, ValueError, "num_local"),
        ({"num_local": None}, TypeError, "num_local"),
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": "0"}, TypeError, "seed"),
    ],
)
def test_config_validation_names_field(kwargs, exc, field):
    with pytest.raises(exc, match=rf"\b{field}\b"):
        MagicPIGConfig(**kwargs)


def test_config_defaults_and_frozen():
    cfg = MagicPIGConfig()
    assert (cfg.K, cfg.L, cfg.num_sink, cfg.num_local, cfg.seed) == (10, 150, 4, 64, 0)
    with pytest.raises(AttributeError):
        cfg.K = 11  # type: ignore[misc]
    assert hash(cfg) == hash(MagicPIGConfig())  # usable as a static jit argument


# ----------------------------------------------------------------------------- baselines


def test_budget_tokens_exact_ceil():
    lengths = np.array([0, 1, 7, 30, 50, 99, 100, 1000, 32767, 32768, 65537, 10**6, 2**31 - 1])
    for f in [0.02, 0.1, 1 / 3, 0.5, 0.999, 1.0, 2.0**-15]:
        got = np.asarray(budget_tokens(f, i32(lengths)))
        frac = fractions.Fraction(f).limit_denominator(1 << 15)
        want = [-((-frac.numerator * int(n)) // frac.denominator) for n in lengths]
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(budget_tokens(0.1, i32([30])), [3])  # not 4 from 0.1 * 30 = 3.0000000000000004
    np.testing.assert_array_equal(budget_tokens(5, i32([0, 3, 10])), [5, 5, 5])


@pytest.mark.parametrize(
    "budget,exc",
    [(0, ValueError), (-3, ValueError), (0.0, ValueError), (1.5, ValueError), (float("nan"), ValueError),
     (1e-6, ValueError), (True, TypeError), ("3", TypeError), (None, TypeError)],
)
def test_budget_validation(budget, exc):
    q, k, v = make_qkv(10)
    with pytest.raises(exc, match="budget"):
        inspect.unwrap(topk_attention)(q, k, v, budget)
    with pytest.raises(exc, match="budget"):
        inspect.unwrap(quest_attention)(q, k, v, 4, budget)
    with pytest.raises(exc, match="budget"):
        inspect.unwrap(oracle_sampling_attention)(jax.random.key(0), q, k, v, budget)


@pytest.mark.parametrize("page_size,exc", [(0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)])
def test_quest_page_size_validation(page_size, exc):
    q, k, v = make_qkv(11)
    with pytest.raises(exc, match="page_size"):
        inspect.unwrap(quest_attention)(q, k, v, page_size, 8)


@pytest.mark.parametrize("budget", [1, 3, 8, 0.1, 0.5, 1.0, 100])
def test_topk_matches_float64(budget):
    q, k, v = make_qkv(12, B=4, Hq=6, Hkv=2, N=23, D=8, scale=1.5)
    lengths = i32([23, 9, 0, 1])
    out, lse = topk_j(q, k, v, budget, lengths)
    tokens = np.asarray(budget_tokens(budget, lengths))
    keep = ref.topk_keep(q, k, tokens, np.asarray(lengths))
    r_out, r_lse = ref.selected(q, k, v, keep)
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-5, atol=1e-6)
    assert np.all(np.isneginf(lse[2])) and np.all(np.asarray(out[2]) == 0)
    d_out, d_lse = dense_j(q, k, v, lengths)
    assert np.all(np.asarray(lse)[:2] <= np.asarray(d_lse)[:2] + 1e-6)


def test_topk_full_budget_is_dense_and_jits():
    q, k, v = make_qkv(13, N=17)
    lengths = i32([17, 4])
    d_out, d_lse = dense_j(q, k, v, lengths)
    f = jax.jit(topk_attention, static_argnames="budget")
    for budget in [17, 1.0, 1000]:
        out, lse = f(q, k, v, budget, lengths)
        np.testing.assert_allclose(out, d_out, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(lse, d_lse, rtol=1e-6)


@pytest.mark.parametrize("page_size,budget", [(4, 8), (4, 3), (4, 0.25), (16, 16), (5, 1.0), (3, 1000), (7, 14)])
def test_quest_matches_float64(page_size, budget):
    q, k, v = make_qkv(14, B=4, Hq=4, Hkv=2, N=37, D=8, scale=1.5, cone=1.0)
    lengths = i32([37, 21, 0, 2])
    out, lse = quest_j(q, k, v, page_size, budget, lengths)
    tokens = np.asarray(budget_tokens(budget, lengths))
    keep = ref.quest_keep(q, k, page_size, tokens, np.asarray(lengths))
    r_out, r_lse = ref.selected(q, k, v, keep)
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-5, atol=1e-6)


def test_quest_page_size_one_is_topk():
    q, k, v = make_qkv(15, N=29)
    lengths = i32([29, 13])
    for budget in [1, 5, 0.3]:
        np.testing.assert_allclose(
            quest_j(q, k, v, 1, budget, lengths)[0], topk_j(q, k, v, budget, lengths)[0],
            rtol=1e-6, atol=1e-7,
        )


def test_quest_upper_bound_holds():
    from magicpig_jax.attention.baselines import quest_page_scores

    q, k, _ = make_qkv(16, N=40, cone=2.0)
    lengths = i32([40, 26])
    scores = np.asarray(quest_page_scores(q, k, 8, lengths))  # [B, Hkv, G, 5]
    logits = np.einsum("bhgd,bhnd->bhgn", np.asarray(q, np.float64).reshape(2, 2, 2, 16), np.asarray(k, np.float64))
    logits /= 4.0
    for b, n in enumerate([40, 26]):
        for j in range(5):
            seg = logits[b, :, :, j * 8 : min(j * 8 + 8, n)]
            if seg.shape[-1] == 0:
                assert np.all(np.isneginf(scores[b, :, :, j]))
            else:
                assert np.all(scores[b, :, :, j] >= seg.max(-1) - 1e-5)


def test_oracle_sampling_counts_are_exact_draws():
    # v_i = e_i (D = N): out * n is the vector of draw counts, so each output is checkable exactly.
    B, Hq, Hkv, N = 2, 4, 2, 16
    rng = np.random.default_rng(17)
    q = jnp.asarray(rng.normal(size=(B, Hq, N)) * 3, jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, Hkv, N, N)), jnp.float32)
    v = jnp.broadcast_to(jnp.eye(N, dtype=jnp.float32), (B, Hkv, N, N))
    lengths = i32([16, 5])
    for budget, draws in [(40, [40, 40]), (0.5, [8, 3])]:
        out, lse, distinct = oracle_j(jax.random.key(1), q, k, v, budget, lengths)
        counts = np.asarray(out, np.float64) * np.asarray(draws)[:, None, None]
        np.testing.assert_allclose(counts, np.round(counts), atol=1e-4)
        np.testing.assert_allclose(counts.sum(-1), np.broadcast_to(np.asarray(draws)[:, None], (B, Hq)), atol=1e-4)
        assert np.all(counts[1, :, 5:] == 0)  # never a key beyond the length
        np.testing.assert_array_equal(distinct, np.sum(np.round(counts) > 0, -1))
        np.testing.assert_allclose(lse, ref.dense(q, k, v, [16, 5])[1], rtol=1e-6)


def test_oracle_sampling_degenerate_distributions():
    q, k, v = make_qkv(18, N=12)
    # One dominant key: every draw is that key.
    k = k.at[:, :, 7].set(q.reshape(2, 2, 2, 16)[:, :, 0] * 100)
    out, _, distinct = oracle_j(jax.random.key(2), q, k, v, 25)
    np.testing.assert_allclose(out[:, ::2], np.asarray(v)[:, :, 7], rtol=1e-6)
    np.testing.assert_array_equal(distinct[:, ::2], 1)
    # A single valid key and an empty row.
    out, lse, distinct = oracle_j(jax.random.key(3), q, k, v, 0.5, i32([1, 0]))
    np.testing.assert_allclose(out[0], np.asarray(v)[0, [0, 0, 1, 1], 0], rtol=1e-6)
    np.testing.assert_array_equal(distinct, [[1] * 4, [0] * 4])
    np.testing.assert_array_equal(out[1], 0.0)
    assert np.all(np.isneginf(lse[1]))


def test_oracle_sampling_seeds():
    q, k, v = make_qkv(19, N=20)
    f = oracle_j
    a = f(jax.random.key(5), q, k, v, 6)
    b = f(jax.random.key(5), q, k, v, 6)
    c = f(jax.random.key(6), q, k, v, 6)
    np.testing.assert_array_equal(a[0], b[0])  # same key, same draws
    assert not np.allclose(a[0], c[0])
    # A raw uint32[2] key works too.
    out, _, _ = oracle_j(jax.random.PRNGKey(0), q, k, v, 6)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("fn", ["topk", "quest", "oracle"])
def test_baselines_bad_shapes(fn):
    q, k, v = make_qkv(20)
    call = {
        "topk": lambda *a: inspect.unwrap(topk_attention)(*a, 4),
        "quest": lambda *a: inspect.unwrap(quest_attention)(*a, 4, 8),
        "oracle": lambda *a: inspect.unwrap(oracle_sampling_attention)(jax.random.key(0), *a, 4),
    }[fn]
    with pytest.raises(ValueError, match="Hkv"):
        call(q[:, :3], k, v)
    with pytest.raises(ValueError, match="k and v"):
        call(q, k[0], v[0])
    with pytest.raises(TypeError, match="floating"):
        call(q, k.astype(jnp.int32), v)
