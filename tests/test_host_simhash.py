"""magicpig_jax.host.simhash: the host kernel's SimHash codes against float64 NumPy signs and
against magicpig_jax.lsh.simhash_codes (the JAX reference), and its argument checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magicpig_jax import host, lsh
from magicpig_jax.host.simhash import host_simhash_codes

IMPLS = ["scalar", "avx2"] if host.has_avx2() else ["scalar"]


def _bits(codes: np.ndarray, K: int) -> np.ndarray:
    """uint32 ``[..., L]`` codes as bits ``[..., L*K]`` (table l's bit j at l*K + j)."""
    j = np.arange(K, dtype=np.uint32)
    return ((codes[..., :, None] >> j) & 1).reshape(*codes.shape[:-1], codes.shape[-1] * K).astype(bool)


def _np_signs(xc32: np.ndarray, proj: np.ndarray):
    """float64 products of the float32 centered rows with the hyperplanes, and the float32 rounding
    bound of each (D * eps32 * sum |x_d P_d|): the sign of a product inside its bound is not decided."""
    x64, p64 = xc32.astype(np.float64), proj.astype(np.float64)
    dots = x64 @ p64
    bound = x64.shape[-1] * 1.2e-7 * (np.abs(x64) @ np.abs(p64)) + 1e-30
    return dots, bound


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=min(20, settings.default.max_examples))  # fewer than the default 100 (CI time)
@given(
    M=st.integers(0, 150),
    D=st.integers(1, 40),
    K=st.integers(1, 32),
    L=st.integers(2, 40),
    bf16=st.booleans(),
    centered=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_codes_are_the_float64_signs_of_the_centered_rows(impl, M, D, K, L, bf16, centered, seed):
    rng = np.random.default_rng(seed)
    groups = 2 if M % 2 == 0 and M > 0 else 1
    x = rng.normal(size=(groups, M // groups, D)).astype(np.float32)
    if bf16:
        x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    center = rng.normal(size=(groups, D)).astype(np.float32) if centered else np.zeros((groups, D), np.float32)
    proj = rng.normal(size=(D, K * L)).astype(np.float32)
    xa = jnp.asarray(x, jnp.bfloat16) if bf16 else jnp.asarray(x)
    got = host_simhash_codes(xa, jnp.asarray(proj), K, L, center=jnp.asarray(center) if centered else None,
                             impl=impl)
    assert got.shape == (groups, M // groups, L) and got.dtype == jnp.uint32
    got = np.asarray(got)
    assert not np.any(got >> np.uint32(K)) if K < 32 else True  # only bits 0..K-1
    xc = (x - center[:, None, :]).astype(np.float32)  # centered in float32, as the kernel does
    dots, bound = _np_signs(xc, proj)
    decided = np.abs(dots) > bound
    np.testing.assert_array_equal(_bits(got, K)[decided], (dots > 0)[decided])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B,H,N,D,K,L", [(1, 9, 1, 64, 10, 150), (2, 3, 100, 64, 12, 37), (1, 2, 7, 5, 3, 7),
                                         (1, 1, 130, 16, 32, 3), (2, 4, 65, 128, 11, 61)])
def test_codes_equal_the_jax_reference(impl, B, H, N, D, K, L):
    rng = np.random.default_rng(B * 1000 + N)
    k = jnp.asarray(rng.normal(size=(B, H, N, D)), jnp.float32)
    mean = jnp.asarray(rng.normal(size=(B, H, D)), jnp.float32)
    proj = lsh.simhash_projections(jax.random.key(N), D, K, L)
    ref = lsh.simhash_codes(k - mean[:, :, None, :], proj, K, L)
    for threads in (0, 1):
        got = host_simhash_codes(k, proj, K, L, center=mean, impl=impl, max_threads=threads)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    # uncentered queries [B, Hq, D], as the decode step hashes them, inside jit
    q = k[:, :, 0]
    got = jax.jit(lambda q: host_simhash_codes(q, proj, K, L, impl=impl))(q)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(lsh.simhash_codes(q, proj, K, L)))
    # bfloat16 rows are widened exactly
    kb = k.astype(jnp.bfloat16)
    got = host_simhash_codes(kb, proj, K, L, center=mean, impl=impl)
    ref = lsh.simhash_codes(kb.astype(jnp.float32) - mean[:, :, None, :], proj, K, L)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_and_nan_rows_give_bit_0_and_vmap_runs_per_element(impl):
    K, L, D = 5, 13, 24
    proj = lsh.simhash_projections(jax.random.key(3), D, K, L)
    x = np.random.default_rng(0).normal(size=(4, D)).astype(np.float32)
    x[1] = 0.0
    x[2, 7] = np.nan
    got = np.asarray(host_simhash_codes(jnp.asarray(x), proj, K, L, impl=impl))
    ref = np.asarray(lsh.simhash_codes(jnp.asarray(x), proj, K, L))
    np.testing.assert_array_equal(got, ref)
    assert not got[1].any() and not got[2].any()
    stacked = jnp.asarray(np.stack([x, -x]))
    got = jax.vmap(lambda a: host_simhash_codes(a, proj, K, L, impl=impl))(jnp.nan_to_num(stacked))
    ref = lsh.simhash_codes(jnp.nan_to_num(stacked), proj, K, L)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale", [2.0**-124, 2.0**-100, 2.0**126])
def test_tiny_and_huge_rows_hash_as_their_unit_scale_rows(impl, scale):
    """A row times a power of two has the same signs against every hyperplane. At 2^-124 (normal
    float32 entries, about 4.7e-38) the products fall below the normal range, which XLA's CPU
    backend flushed to zero (bit 0) before the rows were scaled; at 2^126 products overflowed to ±inf (NaN sums, bit 0).
    Both paths hash the unit-scale row's codes, and the sampling probability u, computed from the
    scaled row, then describes the sampler that ran."""
    K, L, D = 8, 40, 64
    rng = np.random.default_rng(7)
    unit = (rng.uniform(1.0, 2.0, size=(2, 5, D)) * rng.choice([-1.0, 1.0], size=(2, 5, D))).astype(np.float32)
    proj = lsh.simhash_projections(jax.random.key(11), D, K, L)
    ref = np.asarray(lsh.simhash_codes(jnp.asarray(unit), proj, K, L))
    x = jnp.asarray(unit * np.float32(scale))
    assert np.all(np.abs(np.asarray(x)) >= np.finfo(np.float32).tiny)  # normal entries: nothing to flush in x
    np.testing.assert_array_equal(np.asarray(lsh.simhash_codes(x, proj, K, L)), ref)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: lsh.simhash_codes(a, proj, K, L))(x)), ref)
    np.testing.assert_array_equal(np.asarray(host_simhash_codes(x, proj, K, L, impl=impl)), ref)
    # centered: the mean subtracted first, then the row scaled
    mean = jnp.asarray(rng.normal(size=(2, D)).astype(np.float32) * np.float32(scale) * np.float32(0.25))
    want = np.asarray(lsh.simhash_codes(x - mean[:, None, :], proj, K, L))
    np.testing.assert_array_equal(np.asarray(host_simhash_codes(x, proj, K, L, center=mean, impl=impl)), want)


def test_bad_arguments_name_the_parameter():
    proj = jnp.zeros((8, 12), jnp.float32)
    x = jnp.zeros((3, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"projections must be \[D, K\*L\] = \[8, 15\]"):
        host_simhash_codes(x, proj, 3, 5)
    with pytest.raises(ValueError, match=r"center must be \[\*x.shape\[:j\], D\]"):
        host_simhash_codes(x, proj, 3, 4, center=jnp.zeros((2, 8)))
    with pytest.raises(ValueError, match=r"center must be"):
        host_simhash_codes(x, proj, 3, 4, center=jnp.zeros((3, 7)))
    with pytest.raises(ValueError, match="impl must be one of"):
        host_simhash_codes(x, proj, 3, 4, impl="neon")
    with pytest.raises(ValueError, match=r"max_threads must be in \[0, 4096\]"):
        host_simhash_codes(x, proj, 3, 4, max_threads=-1)
    with pytest.raises(ValueError, match="K must be in"):
        host_simhash_codes(x, jnp.zeros((8, 33 * 2)), 33, 2)
    with pytest.raises(ValueError, match="L must be >= 2"):
        host_simhash_codes(x, jnp.zeros((8, 3)), 3, 1)
    with pytest.raises(TypeError, match="x must be a floating dtype"):
        host_simhash_codes(jnp.zeros((3, 8), jnp.int32), proj, 3, 4)
    with pytest.raises(TypeError, match="x must be a floating dtype"):
        host_simhash_codes(jnp.zeros((3, 8), jnp.complex64), proj, 3, 4)
    with pytest.raises(TypeError, match="projections must be a float array, got int32"):  # as lsh.simhash_codes
        host_simhash_codes(x, proj.astype(jnp.int32), 3, 4)
    # no rows: no call, an empty result
    assert host_simhash_codes(jnp.zeros((0, 8)), proj, 3, 4).shape == (0, 4)
