"""magicpig_jax.lsh against independent float64 NumPy/SciPy references."""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from magicpig_jax import lsh

pytestmark = pytest.mark.usefixtures("strict_jax")


def np_simhash_codes(x: np.ndarray, w: np.ndarray, K: int, L: int) -> tuple[np.ndarray, np.ndarray]:
    """Float64 SimHash: bit j of table l is [x · w[:, l*K + j] > 0]; returns (codes uint64, |projections|)."""
    proj = x.astype(np.float64) @ w.astype(np.float64)
    bits = (proj > 0).reshape(*proj.shape[:-1], L, K).astype(np.uint64)
    codes = np.sum(bits << np.arange(K, dtype=np.uint64), axis=-1, dtype=np.uint64)
    return codes, np.abs(proj).reshape(*proj.shape[:-1], L, K)


def np_u(p: np.ndarray, K: int, L: int) -> np.ndarray:
    """P[Binomial(L, p^K) >= 2] in float64 (SciPy's regularized incomplete beta, no cancellation)."""
    return stats.binom.sf(1, L, np.asarray(p, np.float64) ** K)


# ----------------------------------------------------------------------------- projections


def test_projections_shape_dtype_and_determinism():
    w = lsh.simhash_projections(jax.random.key(3), 16, 10, 150)
    assert w.shape == (16, 1500) and w.dtype == jnp.float32
    np.testing.assert_array_equal(w, lsh.simhash_projections(jax.random.key(3), 16, 10, 150))
    assert not np.array_equal(w, lsh.simhash_projections(jax.random.key(4), 16, 10, 150))
    # Standard normal entries: mean ~ 0, variance ~ 1 over 24000 draws (5-sigma bounds).
    wn = np.asarray(w, np.float64)
    assert abs(wn.mean()) < 5 / math.sqrt(wn.size)
    assert abs(wn.var() - 1.0) < 5 * math.sqrt(2 / wn.size)


@pytest.mark.parametrize("head_dim", [0, -3, 2.0, True])
def test_projections_bad_head_dim(head_dim):
    with pytest.raises((ValueError, TypeError), match="head_dim"):
        lsh.simhash_projections(jax.random.key(0), head_dim, 4, 4)


# ----------------------------------------------------------------------------- codes


@pytest.mark.parametrize("K,L", [(1, 2), (4, 7), (10, 150), (11, 30), (31, 3), (32, 4)])
def test_codes_match_float64_numpy(K, L):
    D = 24
    w = lsh.simhash_projections(jax.random.key(K * 1000 + L), D, K, L)
    x = jax.random.normal(jax.random.key(7), (3, 5, D), dtype=jnp.float32) * 3.0
    codes = lsh.simhash_codes(x, w, K, L)
    assert codes.shape == (3, 5, L) and codes.dtype == jnp.uint32
    ref, mag = np_simhash_codes(np.asarray(x), np.asarray(w), K, L)
    got = np.asarray(codes).astype(np.uint64)
    # Bits whose float64 projection is within float32 rounding of 0 may legitimately differ;
    # everywhere else the codes must agree bit for bit.
    unambiguous = np.all(mag > 1e-4, axis=-1)
    assert unambiguous.mean() > 0.95
    np.testing.assert_array_equal(got[unambiguous], ref[unambiguous])
    assert got.max() < 2**K


def test_codes_zero_projection_gives_bit_zero():
    K, L, D = 4, 2, 3
    # Columns: +1, exactly 0, -0.0, -1 on coordinate 0 (x = e0 projects to exactly those).
    col = np.array([1.0, 0.0, -0.0, -1.0, 2.0, 0.0, 0.0, 0.5], np.float32)
    w = np.zeros((D, K * L), np.float32)
    w[0] = col
    w[1] = np.linspace(-1, 1, K * L, dtype=np.float32)  # irrelevant for e0
    e0 = jnp.array([1.0, 0.0, 0.0], jnp.float32)
    codes = np.asarray(lsh.simhash_codes(e0, jnp.asarray(w), K, L))
    # table 0: bits (1, 0, 0, 0) -> 1; table 1: bits (1, 0, 0, 1) -> 1 + 8 = 9.
    np.testing.assert_array_equal(codes, [1, 9])
    # The zero vector projects to exactly 0 everywhere: every code is 0.
    wr = lsh.simhash_projections(jax.random.key(0), D, K, L)
    np.testing.assert_array_equal(lsh.simhash_codes(jnp.zeros((2, D), jnp.float32), wr, K, L), 0)
    # Negative zero input too.
    np.testing.assert_array_equal(lsh.simhash_codes(-jnp.zeros((D,), jnp.float32), wr, K, L), 0)


def test_codes_k32_uses_all_32_bits():
    K, L, D = 32, 3, 8
    w = np.abs(np.asarray(lsh.simhash_projections(jax.random.key(1), D, K, L))) + 0.1
    x = jnp.ones((D,), jnp.float32)
    codes = np.asarray(lsh.simhash_codes(x, jnp.asarray(w), K, L))
    np.testing.assert_array_equal(codes.astype(np.uint64), np.full(L, 2**32 - 1, np.uint64))
    np.testing.assert_array_equal(lsh.simhash_codes(-x, jnp.asarray(w), K, L), 0)
    # Only the top bit set: make column 31 of table 1 the only positive projection of x.
    w2 = -w.copy()
    w2[:, 1 * K + 31] = 1.0
    codes2 = np.asarray(lsh.simhash_codes(x, jnp.asarray(w2), K, L)).astype(np.uint64)
    np.testing.assert_array_equal(codes2, [0, 2**31, 0])


def test_codes_accept_half_precision_inputs():
    K, L, D = 10, 20, 16
    w = lsh.simhash_projections(jax.random.key(2), D, K, L)
    x = jax.random.normal(jax.random.key(3), (6, D)) * 100
    for dt in (jnp.bfloat16, jnp.float16):
        xh = x.astype(dt)
        np.testing.assert_array_equal(
            lsh.simhash_codes(xh, w, K, L), lsh.simhash_codes(xh.astype(jnp.float32), w, K, L)
        )


def test_codes_bad_projection_shape():
    w = lsh.simhash_projections(jax.random.key(0), 8, 4, 5)
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="projections"):
        lsh.simhash_codes(x, w, 4, 6)  # K*L mismatch: only the library's own check sees it
    # D mismatch: the runtime shape check (jaxtyping) rejects it first ...
    with pytest.raises(TypeError, match="projections"):
        lsh.simhash_codes(jnp.ones((2, 9), jnp.float32), w, 4, 5)
    # ... and the library's own check names the parameter too.
    with pytest.raises(ValueError, match="projections"):
        inspect.unwrap(lsh.simhash_codes)(jnp.ones((2, 9), jnp.float32), w, 4, 5)


# ----------------------------------------------------------------------------- collision probability


def test_collision_probability_matches_float64():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(200, 32)).astype(np.float32)
    k = rng.normal(size=(200, 32)).astype(np.float32)
    k[:50] = q[:50] * 0.7 + k[:50] * 0.3  # some strongly aligned pairs
    got = np.asarray(lsh.collision_probability(jnp.asarray(q), jnp.asarray(k)), np.float64)
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    cos = np.sum(q64 * k64, -1) / np.linalg.norm(q64, axis=-1) / np.linalg.norm(k64, axis=-1)
    ref = 1.0 - np.arccos(cos) / np.pi
    assert np.all(np.abs(cos) < 0.999)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6)


def test_collision_probability_near_antiparallel_does_not_cancel():
    """p = 1 - arccos(c)/pi cancelled near c = -1, where p is small (6e-4 relative error at
    c = -0.99999994, 3.7e-3 in log u at K = 3, L = 10); arccos(-c)/pi does not, as the host's LogU."""
    c = np.array([-0.99999994, -0.9999997, -0.999999, -0.9999, -0.99], np.float32)
    got = np.asarray(lsh.collision_probability_from_cosine(jnp.asarray(c)), np.float64)
    ref = np.arccos(-c.astype(np.float64)) / np.pi
    np.testing.assert_allclose(got, ref, rtol=2e-6)
    assert float(lsh.collision_probability_from_cosine(jnp.float32(-1.0))) == 0.0
    assert float(lsh.collision_probability_from_cosine(jnp.float32(1.0))) == 1.0


def test_collision_probability_clamps_parallel_and_antiparallel():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(500, 64)).astype(np.float32) * rng.uniform(0.01, 300, (500, 1)))
    scale = jnp.asarray(rng.uniform(0.1, 10.0, (500, 1)).astype(np.float32))
    p_par = np.asarray(lsh.collision_probability(x, x * scale))
    p_anti = np.asarray(lsh.collision_probability(x, -x * scale))
    assert not np.any(np.isnan(p_par)) and not np.any(np.isnan(p_anti))
    # True value 1 (resp. 0). The float32 cosine lands within a few ulps of +-1 (clamped
    # when it rounds beyond), and arccos(1 - 2e-7) = 6.3e-4 rad is float32's resolution there.
    assert np.all(p_par <= 1.0) and np.all(p_par >= 1.0 - 2e-4)
    assert np.all(p_anti >= 0.0) and np.all(p_anti <= 2e-4)
    assert np.mean(p_par == 1.0) > 0.5  # most cosines round to >= 1 and clamp to exactly 1
    # Downstream u stays finite and ~1 (K=32: p^32 >= 0.9936).
    u = np.asarray(lsh.sampling_probability(jnp.asarray(p_par), 32, 2))
    assert np.all(u >= float(np_u(1.0 - 2e-4, 32, 2)) * (1 - 1e-5))
    # Cosines computed (or given) above 1 / below -1 are clamped, never NaN.
    np.testing.assert_array_equal(
        lsh.collision_probability_from_cosine(jnp.array([1.0000001, 1.5, -1.0000001, -7.0], jnp.float32)),
        [1.0, 1.0, 0.0, 0.0],
    )


def test_collision_probability_zero_vectors_are_half():
    z = jnp.zeros((3, 8), jnp.float32)
    x = jnp.ones((3, 8), jnp.float32)
    np.testing.assert_array_equal(lsh.collision_probability(z, x), 0.5)
    np.testing.assert_array_equal(lsh.collision_probability(x, z), 0.5)
    np.testing.assert_array_equal(lsh.collision_probability(z, z), 0.5)


def test_collision_probability_broadcasts():
    q = jnp.ones((1, 8), jnp.float32)
    k = jnp.concatenate([jnp.ones((1, 8)), -jnp.ones((1, 8)), jnp.zeros((1, 8))], 0)
    np.testing.assert_array_equal(lsh.collision_probability(q, k), [1.0, 0.0, 0.5])


# ----------------------------------------------------------------------------- sampling probability

K_GRID = [1, 2, 3, 5, 8, 10, 11, 16, 20, 32]
L_GRID = [2, 3, 4, 10, 50, 100, 150, 170, 300, 1000, 5000]


def _p_grid() -> np.ndarray:
    tiny = np.geomspace(1e-8, 0.05, 400)
    return np.unique(
        np.concatenate([[0.0, 1.0], np.linspace(0, 1, 4001), tiny, 1 - tiny]).astype(np.float32)
    )


@pytest.mark.parametrize("K", K_GRID)
def test_sampling_probability_matches_scipy_binomial(K):
    p = _p_grid()
    p64 = p.astype(np.float64)  # reference at exactly the float32 inputs
    for L in L_GRID:
        log_u = np.asarray(lsh.log_sampling_probability(jnp.asarray(p), K, L), np.float64)
        u = np.asarray(lsh.sampling_probability(jnp.asarray(p), K, L), np.float64)
        ref = np_u(p64, K, L)
        assert not np.any(np.isnan(log_u)), (K, L)
        assert np.all((u >= 0) & (u <= 1)), (K, L)
        # -inf only at p = 0 (where u = 0 exactly); finite everywhere else.
        assert np.all(np.isneginf(log_u) == (p64 == 0)), (K, L)
        big = ref >= 1e-30
        rel = np.abs(u[big] - ref[big]) / ref[big]
        # measured: 1.1e-5 over this grid (K up to 32, L up to 5000)
        assert rel.max(initial=0.0) < 1e-4, (K, L, p64[big][np.argmax(rel)], rel.max())
        # In log space the same bound (|log(1 + e)| < 1.0001e-4 for |e| < 1e-4).
        np.testing.assert_allclose(log_u[big], np.log(ref[big]), rtol=0, atol=1.0001e-4)
        # Monotone non-decreasing in p (u is a tail probability of a binomial in p).
        assert np.all(np.diff(u) >= -1e-6 * np.maximum(u[1:], 1e-30)), (K, L)


def test_sampling_probability_notes_examples():
    # The catastrophic-cancellation example of the notes: p=0.3, K=10, L=100.
    u = float(lsh.sampling_probability(jnp.float32(0.3), 10, 100))
    assert u == pytest.approx(float(np_u(np.float32(0.3), 10, 100)), rel=1e-4)
    assert u == pytest.approx(1.7253e-7, rel=1e-3)
    # K10L150: orthogonal centered key (p = 1/2) ~ 0.0097; cos 0.5 (p = 2/3) ~ 0.74.
    assert float(lsh.sampling_probability(jnp.float32(0.5), 10, 150)) == pytest.approx(
        float(np_u(0.5, 10, 150)), rel=1e-5
    )
    assert float(np_u(0.5, 10, 150)) == pytest.approx(0.0097, abs=5e-5)
    p = lsh.collision_probability_from_cosine(jnp.float32(0.5))
    assert float(lsh.sampling_probability(p, 10, 150)) == pytest.approx(0.74, abs=5e-3)


def test_sampling_probability_endpoints_and_clipping():
    p = jnp.array([-0.5, 0.0, 1.0, 1.5], jnp.float32)
    for K, L in [(1, 2), (10, 150), (32, 5000)]:
        np.testing.assert_array_equal(lsh.sampling_probability(p, K, L), [0.0, 0.0, 1.0, 1.0])
        log_u = np.asarray(lsh.log_sampling_probability(p, K, L))
        np.testing.assert_array_equal(log_u, [-np.inf, -np.inf, 0.0, 0.0])


def test_sampling_probability_shape_preserved():
    p = jnp.full((2, 3, 4), 0.7, jnp.float32)
    assert lsh.sampling_probability(p, 10, 150).shape == (2, 3, 4)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "K,L,exc,name",
    [
        (0, 10, ValueError, "K"),
        (33, 10, ValueError, "K"),
        (-1, 10, ValueError, "K"),
        (10, 1, ValueError, "L"),
        (10, 0, ValueError, "L"),
        (True, 10, TypeError, "K"),
        (10, False, TypeError, "L"),
        (10.0, 10, TypeError, "K"),
        (10, 2.5, TypeError, "L"),
    ],
)
def test_validate_k_l_errors(K, L, exc, name):
    with pytest.raises(exc, match=rf"\b{name}\b"):
        lsh.validate_k_l(K, L)
    with pytest.raises(exc, match=rf"\b{name}\b"):
        lsh.sampling_probability(jnp.float32(0.5), K, L)


def test_validate_k_l_accepts_range_ends():
    for K, L in [(1, 2), (32, 2), (32, lsh.MAX_L)]:
        assert lsh.validate_k_l(K, L) is None
    with pytest.raises(ValueError, match=f"L must be <= {lsh.MAX_L}"):  # a huge L ran out of memory late
        lsh.validate_k_l(10, lsh.MAX_L + 1)
