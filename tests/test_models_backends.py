"""magicpig_jax.models.backends: each sparse backend's attend, on inputs whose exact answer is known."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magicpig_jax.attention import MagicPIGConfig
from magicpig_jax.models.backends import DecodeSpec, MiddleRange, backend_for
from tests import _np_reference as ref
from tests._jitted import i32, make_qkv


@pytest.mark.parametrize("budget", [1, 8, 0.05])
def test_oracle_backend_is_exact_when_the_sampled_values_are_equal(budget):
    # The oracle backend draws from the hashed range [start, end) and keeps the static set (sinks,
    # local window, keys past the range) exact. With every value of the hashed range equal (per KV
    # head), any draw returns that value, so the estimate is exact whatever the budget: the merged
    # result must equal dense attention (float64). Counting a static key in both parts (e.g. the
    # local window sampled as well) changes the weights and breaks this.
    cfg = MagicPIGConfig(num_sink=4, num_local=16)
    spec = DecodeSpec("oracle", cfg, (), budget=budget)
    q, k, v = make_qkv(3, B=2, Hq=4, Hkv=2, N=100, D=8)
    lengths = i32([100, 77])
    build_lengths = i32([90, 60])  # a few generated tokens past the range, exact as well
    state = MiddleRange.from_lengths(build_lengths, cfg)
    start, end = np.asarray(state.start), np.asarray(state.end)
    v = np.asarray(v).copy()
    const = np.random.default_rng(4).normal(size=(2, 2, 8))
    for b in range(2):
        v[b, :, start[b] : end[b]] = const[b][:, None, :]
    v = jnp.asarray(v)
    out, lse, used = backend_for(spec).attend(spec, q, k, v, state, lengths, jax.random.key(0))
    o64, l64 = ref.dense(q, k, v, np.asarray(lengths))
    np.testing.assert_allclose(np.asarray(out), o64, rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), l64, rtol=0, atol=2e-6)
    used = np.asarray(used)
    assert np.all((used >= 1) & (used <= (end - start)[:, None]))
