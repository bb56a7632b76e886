"""magicpig_jax.lsh: the dtype, shape and message promises of its docstrings (each test kills
mutants that survived the value tests of tests/test_lsh.py; docs/mutation.md lists them)."""

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


def _p64(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    q, k = q.astype(np.float64), k.astype(np.float64)
    cos = np.sum(q * k, -1) / (np.linalg.norm(q, axis=-1) * np.linalg.norm(k, axis=-1))
    return 1 - np.arccos(np.clip(cos, -1, 1)) / math.pi


def test_validate_messages_name_the_type_and_value():
    # a bool passes the tests' runtime type checker (it is an int) and reaches the library's check
    with pytest.raises(TypeError, match=r"^L must be an int, got bool True$"):
        lsh.validate_k_l(2, True)
    with pytest.raises(TypeError, match=r"^K must be an int, got bool False$"):
        lsh.validate_k_l(False, 4)
    validate = inspect.unwrap(lsh.validate_k_l)  # past the type checker
    with pytest.raises(TypeError, match=r"^K must be an int, got float 2\.0$"):
        validate(2.0, 4)


def test_projections_accept_head_dim_one_and_stay_float32_under_x64():
    assert lsh.simhash_projections(jax.random.key(0), 1, 3, 4).shape == (1, 12)
    with pytest.raises(ValueError, match="head_dim"):
        lsh.simhash_projections(jax.random.key(0), 0, 3, 4)
    with jax.enable_x64(True):
        w = lsh.simhash_projections(jax.random.key(0), 5, 3, 4)
        assert w.dtype == jnp.float32
        codes = lsh.simhash_codes(jnp.ones((2, 5), jnp.float64), w, 3, 4)
        assert codes.dtype == jnp.uint32 and codes.shape == (2, 4)
        # float32 results from float64 inputs (astype(None) would keep float64 here)
        x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 5)))
        assert lsh.collision_probability(x, x[::-1]).dtype == jnp.float32
        assert lsh.collision_probability_from_cosine(jnp.asarray([0.25, -1.0])).dtype == jnp.float32
        assert lsh.log_sampling_probability(jnp.asarray([0.5, 0.9]), 10, 150).dtype == jnp.float32


def test_codes_shape_message_gives_the_expected_shape():
    w = jnp.zeros((8, 20), jnp.float32)
    with pytest.raises(ValueError, match=r"projections must have shape \[D, K\*L\] = \[8, 24\], got \(8, 20\)"):
        lsh.simhash_codes(jnp.ones((2, 3, 8), jnp.float32), w, 4, 6)


def test_codes_of_bfloat16_inputs_are_those_of_their_float32_values():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(50, 16)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(16, 24)), jnp.bfloat16)
    want = lsh.simhash_codes(x.astype(jnp.float32), w.astype(jnp.float32), 4, 6)
    np.testing.assert_array_equal(lsh.simhash_codes(x, w.astype(jnp.float32), 4, 6), want)  # strict promotion
    np.testing.assert_array_equal(lsh.simhash_codes(x.astype(jnp.float32), w, 4, 6), want)


def test_collision_probability_on_batched_small_and_bfloat16_vectors():
    rng = np.random.default_rng(1)
    q = rng.normal(size=(2, 3, 8)).astype(np.float32)
    k = rng.normal(size=(2, 3, 8)).astype(np.float32)
    # 3-D inputs: the sums run over the last axis
    np.testing.assert_allclose(lsh.collision_probability(jnp.asarray(q), jnp.asarray(k)), _p64(q, k), atol=2e-6)
    # norms below 1: p is scale-free (|q||k| = 1e-4 here)
    small = lsh.collision_probability(jnp.asarray(0.01 * q / np.linalg.norm(q, axis=-1, keepdims=True)),
                                      jnp.asarray(0.01 * k / np.linalg.norm(k, axis=-1, keepdims=True)))
    np.testing.assert_allclose(small, _p64(q, k), atol=2e-6)
    # bfloat16 inputs are computed in float32 (as their float32 values)
    qb, kb = jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16)
    np.testing.assert_array_equal(lsh.collision_probability(qb, kb),
                                  lsh.collision_probability(qb.astype(jnp.float32), kb.astype(jnp.float32)))
    cb = jnp.asarray(np.linspace(-1, 1, 101), jnp.bfloat16)
    np.testing.assert_array_equal(lsh.collision_probability_from_cosine(cb),
                                  lsh.collision_probability_from_cosine(cb.astype(jnp.float32)))


def test_log_u_of_bfloat16_p_is_that_of_its_float32_value():
    p = jnp.asarray(np.linspace(0.01, 1.0, 200), jnp.bfloat16)
    got = lsh.log_sampling_probability(p, 10, 150)
    np.testing.assert_array_equal(got, lsh.log_sampling_probability(p.astype(jnp.float32), 10, 150))
    ref = np.log(stats.binom.sf(1, 150, np.asarray(p.astype(jnp.float32), np.float64) ** 10))
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=0, atol=1e-4)
