"""magicpig_jax.host.log_u: the kernel's ``log u`` against SciPy's binomial tail (not against the
float64 function that builds the kernel's table), over p in [0, 1], K in 1..16 and L in 2..1000."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from magicpig_jax import host
from magicpig_jax.attention.magicpig import LOG_U_FLOOR
from magicpig_jax.host.log_u import LOG_U_TABLE_SIZE, log_u_table, table_operand, table_size

IMPLS = ["scalar", "avx2"] if host.has_avx2() else ["scalar"]

# L sampled over [2, 1000]: the ends, small values, the paper's, powers of two and odd values.
L_GRID = [2, 3, 4, 5, 7, 10, 16, 31, 64, 100, 150, 170, 256, 300, 499, 777, 1000]


def _p_grid() -> np.ndarray:
    tiny = np.geomspace(1e-6, 0.05, 300)
    return np.unique(np.concatenate([[0.0, 1.0], np.linspace(0.0, 1.0, 2001), tiny, 1.0 - tiny]))


def _scipy_log_u(cos32: np.ndarray, K: int, L: int) -> np.ndarray:
    """``max(log P[Binomial(L, p^K) >= 2], LOG_U_FLOOR)``, p = 1 - arccos(cos)/pi, in float64 (SciPy)."""
    p = 1.0 - np.arccos(np.clip(cos32.astype(np.float64), -1.0, 1.0)) / math.pi
    with np.errstate(divide="ignore"):
        log_u = np.log(stats.binom.sf(1, L, p**K))
    return np.maximum(log_u, LOG_U_FLOOR)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("K", range(1, 17))
def test_host_log_u_matches_scipy_binomial_tail(K, impl):
    # the cosine whose collision probability is p (in float32, as the kernel receives it)
    cos = (-np.cos(math.pi * _p_grid())).astype(np.float32)
    for L in L_GRID:
        got = np.asarray(host.host_log_u(jnp.asarray(cos), K, L, impl=impl), np.float64)
        ref = _scipy_log_u(cos, K, L)
        assert np.all(np.isfinite(got)), (K, L)
        err = np.abs(got - ref)
        # measured: 3.4e-6 where |log u| < 1, 1.2e-5 at log u = -68 (2e-7 relative: float32)
        bound = 5e-6 + 2e-7 * np.abs(ref)
        worst = int(np.argmax(err - bound))
        assert np.all(err <= bound), (K, L, float(cos[worst]), got[worst], ref[worst])
        # p = 0 (cos = -1) is floored; the floor is reached, never passed
        assert got[0] == np.float32(LOG_U_FLOOR) and got.min() >= np.float32(LOG_U_FLOOR)


def test_table_size_grows_where_log_u_bends_over_a_narrow_range():
    assert table_size(10, 150) == LOG_U_TABLE_SIZE == 1 << 14
    assert table_size(1, 1000) == 1 << 17  # 128 * 1 * 1000 = 128,000 intervals needed
    assert table_size(2, 1000) == 1 << 14  # 128 * 2 * sqrt(1000) = 8,095
    assert table_size(1, 4096) == 1 << 19
    # the operand the kernel reads: T + 1 float64 values as uint32 pairs
    assert table_operand(1, 1000).shape == ((1 << 17) + 1, 2)
    np.testing.assert_array_equal(np.asarray(table_operand(3, 7)).view(np.float64).ravel(), log_u_table(3, 7))
