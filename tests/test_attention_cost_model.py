"""magicpig_jax.attention.cost_model: the expected sampled fraction against float64 SciPy, and the L solver."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from magicpig_jax.attention import cost_model


def u64(cos, K, L):
    p = 1 - np.arccos(np.clip(cos, -1, 1)) / np.pi
    return stats.binom.sf(1, L, p**K)


def test_expected_sampled_fraction_matches_float64():
    cos = np.random.default_rng(0).normal(0, 0.3, 500).clip(-1, 1)
    for K, L in [(10, 150), (8, 60), (11, 300)]:
        want = float(np.mean(u64(cos, K, L)))
        assert cost_model.expected_sampled_fraction(cos, K, L) == pytest.approx(want, rel=1e-4)


def test_tables_for_fraction_is_the_smallest_l():
    cos = np.random.default_rng(1).normal(0, 0.1, 1000).clip(-1, 1)
    L = cost_model.tables_for_fraction(cos, 10, 0.02)
    assert np.mean(u64(cos, 10, L)) >= 0.02 * (1 - 1e-4)
    assert np.mean(u64(cos, 10, L - 1)) < 0.02 * (1 + 1e-4)
    assert cost_model.tables_for_fraction(np.ones(3), 10, 0.5) == 2  # p = 1: always sampled


@pytest.mark.parametrize("target", [0.0, 1.0, -0.1, 2])
def test_tables_for_fraction_bad_target(target):
    with pytest.raises(ValueError, match="target"):
        cost_model.tables_for_fraction(np.zeros(4), 10, target)


def test_tables_for_fraction_unreachable():
    with pytest.raises(ValueError, match="not reached"):
        cost_model.tables_for_fraction(-np.ones(4), 10, 0.5, max_L=64)  # p = 0: never sampled


def test_expected_sampled_fraction_bad_input():
    with pytest.raises(ValueError, match="empty"):
        cost_model.expected_sampled_fraction(np.zeros(0), 10, 150)
    with pytest.raises(ValueError, match="K"):
        cost_model.expected_sampled_fraction(np.zeros(3), 0, 150)


def test_expected_sampled_fraction_refuses_impossible_cosines():
    """A cosine of 2.0 was clipped to 1 and returned a fraction of 1.0."""
    with pytest.raises(ValueError, match=r"cosines must be in \[-1, 1\]"):
        cost_model.expected_sampled_fraction(np.array([0.1, 2.0]), 10, 150)
    assert cost_model.expected_sampled_fraction(np.array([1.0 + 1e-7, -1.0]), 10, 150) == pytest.approx(0.5, abs=1e-6)
