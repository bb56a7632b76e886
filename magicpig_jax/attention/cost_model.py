"""MagicPIG's cost model: the expected fraction of hashed keys sampled, and the ``L`` reaching a target.

The cost of a MagicPIG step is proportional to the number of keys it samples (arXiv
2410.16179, Section 5). A key with collision probability ``p = 1 - arccos(cos)/pi`` per
hash bit is sampled with probability ``u(p; K, L)`` (Section 4.2, Eq. (9)), so by linearity
of expectation the expected sampled fraction of a set of keys is ``mean_i u(p_i; K, L)``
whatever the dependence between keys (``proofs/cost_model.md``, checked by
``proofs/cost_model.py``).

Pure: imports only NumPy, JAX and :mod:`magicpig_jax.lsh`, so it runs without the compiled
host extension.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Float

from magicpig_jax import lsh

__all__ = ["expected_sampled_fraction", "tables_for_fraction"]


def expected_sampled_fraction(cosines: Float[np.ndarray, "..."], K: int, L: int) -> float:
    """Expected fraction of hashed keys MagicPIG samples: ``mean_i u(p_i; K, L)``.

    ``p_i = 1 - arccos(cos_i)/pi`` and ``u`` is :func:`magicpig_jax.lsh.sampling_probability`;
    by linearity of expectation the expected number of sampled keys is ``sum_i u_i``
    whatever the dependence between keys (proofs/cost_model.md).

    Args:
      cosines: float ``[n]`` (any shape; flattened) cosines between the query and the centered keys, n >= 1.
      K: bits per table, 1..32.
      L: tables, >= 2.

    Returns:
      A float in ``[0, 1]`` (a fraction of the keys, not a count).

    Raises:
      ValueError: empty ``cosines``, NaN cosines or cosines outside ``[-1, 1]`` (by more than
        rounding), or invalid ``K``/``L``.
      TypeError: non-integer ``K``/``L``.

    Source: arXiv 2410.16179, Section 4.2 (Eq. (9)) and Section 5 (cost ~ fraction sampled).
    """
    lsh.validate_k_l(K, L)
    c = np.asarray(cosines, np.float64).ravel()
    if c.size == 0:
        raise ValueError("cosines must not be empty")
    if np.any(np.isnan(c)):
        raise ValueError("cosines must not contain NaN")
    if np.any(np.abs(c) > 1.0 + 1e-6):  # rounding may put a computed cosine just past 1
        raise ValueError(f"cosines must be in [-1, 1], got values in [{c.min()}, {c.max()}]")
    p = lsh.collision_probability_from_cosine(jnp.asarray(c, jnp.float32))
    return float(np.mean(np.asarray(lsh.sampling_probability(p, K, L), np.float64)))


def tables_for_fraction(
    cosines: Float[np.ndarray, " n"], K: int, target: float | int | np.floating, max_L: int = lsh.MAX_L
) -> int:
    """The smallest ``L >= 2`` whose expected sampled fraction reaches ``target``.

    ``u`` is strictly increasing in ``L`` (``u(L+1) - u(L) = L P^2 (1-P)^(L-1)``), so
    the fraction is too and an exponential + binary search finds the boundary.

    Args:
      cosines: float ``[n]`` cosines between the query and the centered keys.
      K: bits per table, 1..32.
      target: fraction in ``(0, 1)`` (an int is accepted only to be refused with the reason).
      max_L: the largest L considered, in ``[2, lsh.MAX_L]`` (default ``lsh.MAX_L``).

    Returns:
      int ``L`` with ``expected_sampled_fraction(cosines, K, L) >= target`` and
      (if ``L > 2``) ``expected_sampled_fraction(cosines, K, L - 1) < target``.

    Raises:
      TypeError: ``K`` not an int.
      ValueError: ``target`` outside ``(0, 1)``, ``K`` out of range, an invalid ``max_L``, or a target not reachable
        with ``L <= max_L``.

    Source: arXiv 2410.16179, Section 4.2 (Eq. (9)); proofs/cost_model.md (monotonicity in L).
    """
    if isinstance(target, bool) or not (isinstance(target, float | int | np.floating | np.integer)
                                        and 0 < target < 1):
        raise ValueError(f"target must be a fraction in (0, 1), got target={target!r}")
    target = float(target)
    lsh.validate_k_l(K, 2)
    if isinstance(max_L, bool) or not isinstance(max_L, int | np.integer) or not 2 <= max_L <= lsh.MAX_L:
        raise ValueError(f"max_L must be an int in [2, {lsh.MAX_L}] (lsh.MAX_L), got max_L={max_L!r}")
    max_L = int(max_L)

    def f(L: int) -> float:
        return expected_sampled_fraction(cosines, K, L)

    if f(2) >= target:
        return 2
    lo, hi = 2, min(4, max_L)
    while f(hi) < target:  # doubling, never past max_L
        if hi == max_L:
            raise ValueError(f"target fraction {target} is not reached with K={K} and L <= {max_L}")
        lo, hi = hi, min(2 * hi, max_L)
    while hi - lo > 1:  # invariant: f(lo) < target <= f(hi)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if f(mid) >= target else (mid, hi)
    return hi
