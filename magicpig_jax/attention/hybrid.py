"""Hybrid LSH estimator: keys whose collision count marks them heavy are kept exactly, the rest
importance-sampled with the probability the estimator actually used.

MagicPIG samples a key of the hashed range when its code equals the query's in ``X >= 2`` of
the L tables, ``X ~ Binomial(L, P)`` over the draw of the hyperplanes, ``P = p^K``, and weights
it by ``1/u``, ``u = P[X >= 2]`` (arXiv 2410.16179, Eq. (4), (9)). The hybrid (an option
suggested by vAttention's top-k plus sampling) splits the sampled keys by their collision
count, with a threshold ``m >= 3``:

* heavy, ``X >= m``: kept with weight 1 (its exact logit);
* light, ``2 <= X < m``: weight ``1 / u_c``, ``u_c = P[X >= 2 | X < m] = P[2 <= X < m] / P[X < m]``,
  the probability with which a key that is *not* heavy is sampled.

Each key's term then has expectation 1 (``h + P[2 <= X < m] / u_c = h + (1 - h) = 1`` with
``h = P[X >= m]``), so the unnormalized estimator is unbiased and the self-normalized one
consistent, like MagicPIG's. The sampled set, and so the cost, is MagicPIG's exactly; only the
weights differ. ``proofs/hybrid.md`` derives this and the per-key variance
``(1-u)(1-h)/(u-h)``, which is never below MagicPIG's ``(1-u)/u``: the split cannot help a key
taken alone; what it changes is how errors of ``u`` and correlations between keys enter.
With ``m = L + 1`` nothing is heavy, ``u_c = u``, and the hybrid is MagicPIG.

``log u_c`` is computed in float32 without cancellation: with ``r = log(P / (1 - P))`` and
``c_j = log C(L, j)`` (float64 constants),
``log u_c = LSE_{2 <= j < m}(c_j + j r) - LSE_{0 <= j < m}(c_j + j r)`` (the common factor
``(1 - P)^L`` cancels), floored at ``LOG_U_FLOOR`` like ``log u``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from magicpig_jax import lsh
from magicpig_jax.attention._common import (
    check_lengths,
    check_qkv,
    check_softcap,
    grouped_logits,
    masked_softmax_attention,
)
from magicpig_jax.attention.config import MagicPIGConfig, _check_count
from magicpig_jax.attention.magicpig import LOG_U_FLOOR, LSHIndex, check_index_fits, nan_if_not_finite

__all__ = ["HybridConfig", "hybrid_attention", "log_light_probability", "hybrid_log_weights"]

_LOG_ODDS_CLIP = 1e4  # |log(P / (1 - P))| beyond this changes no weight in float32


@dataclasses.dataclass(frozen=True)
class HybridConfig(MagicPIGConfig):
    """:class:`MagicPIGConfig` plus the heavy threshold of the hybrid estimator.

    Attributes:
      heavy: ``m``, the collision count (tables where the key's code equals the query's) from
        which a sampled key is kept exactly; ``3 <= m <= L + 1`` (``L + 1``: nothing is heavy,
        the estimator is MagicPIG's).

    Raises:
      TypeError: a field is not an int.
      ValueError: a field out of range (the message names it).

    Source: ``proofs/hybrid.md`` (the estimator and its unbiasedness), after vAttention (2025):
    exact top keys plus importance sampling of the rest.
    """

    heavy: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_count("heavy", self.heavy)
        if not 3 <= self.heavy <= self.L + 1:
            raise ValueError(f"heavy must be in [3, L + 1] = [3, {self.L + 1}], got heavy={self.heavy}")


def _log_binom(L: int, m: int) -> np.ndarray:
    return np.array([math.lgamma(L + 1) - math.lgamma(j + 1) - math.lgamma(L - j + 1) for j in range(m)],
                    np.float64)


def log_light_probability(p: Float[Array, "..."], K: int, L: int, heavy: int) -> Float[Array, "..."]:
    """``log u_c``, ``u_c = P[X >= 2 | X < m]`` with ``X ~ Binomial(L, p^K)`` and ``m = heavy``.

    Args:
      p: per-bit collision probability, any shape, in ``[0, 1]`` (clipped).
      K, L: bits per table and tables (validated as for MagicPIG).
      heavy: ``m``, ``3 <= m <= L + 1``.

    Returns:
      float32, same shape; ``-inf`` where ``p = 0`` (then ``u_c = 0``), ``0`` where ``P = 1``,
      NaN where ``p`` is NaN (as :func:`magicpig_jax.lsh.log_sampling_probability`).

    Raises:
      ValueError / TypeError: invalid K, L or heavy.

    Source: ``proofs/hybrid.md`` (the light keys' probability), from arXiv 2410.16179, Section 4.2.
    """
    lsh.validate_k_l(K, L)
    _check_count("heavy", heavy)  # a float failed in range() with a message naming nothing
    if not 3 <= heavy <= L + 1:
        raise ValueError(f"heavy must be in [3, L + 1] = [3, {L + 1}], got heavy={heavy}")
    p = jnp.clip(jnp.asarray(p, jnp.float32), 0.0, 1.0)
    log_P = K * jnp.log(p)
    log_odds = log_P - jnp.log1p(-jnp.exp(log_P))
    log_odds = jnp.clip(jnp.where(jnp.isnan(log_odds), _LOG_ODDS_CLIP, log_odds), -_LOG_ODDS_CLIP, _LOG_ODDS_CLIP)
    shape = (1,) * log_odds.ndim + (heavy,)
    c = jnp.asarray(_log_binom(L, heavy), jnp.float32).reshape(shape)
    j = jnp.arange(heavy, dtype=jnp.float32).reshape(shape)
    terms = c + j * log_odds[..., None]  # [..., m]
    num = jax.scipy.special.logsumexp(terms[..., 2:], axis=-1)
    den = jax.scipy.special.logsumexp(terms, axis=-1)
    return jnp.where(p > 0, jnp.minimum(num - den, 0.0), jnp.where(jnp.isnan(p), jnp.nan, -jnp.inf))


def hybrid_log_weights(hits: Int[Array, "..."], p: Float[Array, "..."], K: int, L: int,
                       heavy: int) -> Float[Array, "..."]:
    """The hybrid's ``-log`` weight of each key from its collision count: 0 if heavy, ``log u_c`` if light.

    Args:
      hits: int, tables where the key's code equals the query's (``X``).
      p: the key's per-bit collision probability (same shape).
      K, L, heavy: the configuration.

    Returns:
      float32: ``0`` where ``hits >= heavy``, ``max(log u_c, LOG_U_FLOOR)`` elsewhere (the value
      matters only where ``hits >= 2``); NaN where ``p`` is NaN and the key is light.

    Raises:
      ValueError / TypeError: invalid K, L or heavy (:func:`log_light_probability`).

    Source: ``proofs/hybrid.md``.
    """
    log_uc = jnp.maximum(log_light_probability(p, K, L, heavy), LOG_U_FLOOR)
    return jnp.where(hits >= heavy, 0.0, log_uc)


def _hits_and_cos(q, k, index: LSHIndex, config: MagicPIGConfig, lengths):
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    pos = jnp.arange(N, dtype=jnp.int32)
    valid = pos[None, :] < lengths[:, None]
    in_range = (pos[None, :] >= index.start[:, None]) & (pos[None, :] < index.end[:, None]) & valid
    q_codes = lsh.simhash_codes(q, index.projections, config.K, config.L).reshape(B, Hkv, G, 1, config.L)
    hits = jnp.sum(q_codes == index.codes[:, :, None, :, :], axis=-1, dtype=jnp.int32)
    kc = lsh.exponent_scaled(k.astype(jnp.float32) - index.mean[:, :, None, :])
    qg = lsh.exponent_scaled(q.reshape(B, Hkv, G, D))
    dots = jnp.einsum("bhgd,bhnd->bhgn", qg, kc, precision=jax.lax.Precision.HIGHEST)
    cos = lsh.cosine_from_dots(dots, qg[..., None, :], kc[:, :, None, :, :])
    return hits, cos, in_range[:, None, None, :], (valid & ~in_range)[:, None, None, :]


def hybrid_attention(
    q: Float[Array, "B Hq D"],
    k: Float[Array, "B Hkv N D"],
    v: Float[Array, "B Hkv N D"],
    index: LSHIndex,
    config: HybridConfig,
    lengths: Int[Array, " B"] | None = None,
    *,
    softcap: float | None = None,
) -> tuple[Float[Array, "B Hq D"], Float[Array, "B Hq"], Int[Array, "B Hq"]]:
    """One decode step of the hybrid estimator (pure JAX; the module docstring has the rule).

    Same conventions as :func:`magicpig_jax.attention.magicpig_attention`: keys of the hashed
    range ``[start, end)`` are sampled when ``hits >= 2``; heavy ones (``hits >= config.heavy``)
    enter the softmax with their exact logit, light ones with ``q·k/sqrt(D) - log u_c``; every
    other valid key is exact.

    Args:
      q: float ``[B, Hq, D]``.
      k, v: float ``[B, Hkv, N, D]``.
      index: the :class:`LSHIndex` of these keys (built with the same K, L).
      config: a :class:`HybridConfig`.
      lengths: int ``[B]`` valid keys per row (default N).
      softcap: None, or c in [0.001, 1e6]: every logit ``s`` becomes ``c * tanh(s / c)`` before
        ``log u_c`` is subtracted (Gemma 2's ``attn_logit_softcapping``, as in
        :func:`~magicpig_jax.attention.magicpig_attention`; the hits, by angle, are unchanged).

    Returns:
      ``(out, lse, num_sampled)``: out float32 ``[B, Hq, D]``, natural-log lse float32 ``[B, Hq]``,
      num_sampled int32 ``[B, Hq]`` (heavy and light: the keys touched, as MagicPIG's). A head
      whose index mean is not finite gets out and lse NaN, as in MagicPIG.

    Raises:
      TypeError: ``config`` is not a :class:`HybridConfig`, or ``index`` not an :class:`LSHIndex`.
      ValueError: bad shapes, an index that does not fit, or a softcap out of range.

    Source: ``proofs/hybrid.md``; arXiv 2410.16179, Eq. (4) and (9).
    """
    if not isinstance(config, HybridConfig):
        raise TypeError(f"config must be a HybridConfig, got {type(config).__name__}")
    softcap = check_softcap(softcap)
    B, Hq, Hkv, N, D = check_qkv(q, k, v)
    check_index_fits(index, config, B, Hkv, N, D)
    lengths = check_lengths(lengths, B, N)
    hits, cos, in_range, static = _hits_and_cos(q, k, index, config, lengths)
    sampled = (hits >= 2) & in_range
    log_w = hybrid_log_weights(hits, lsh.collision_probability_from_cosine(cos), config.K, config.L, config.heavy)
    logits = grouped_logits(q, k, softcap)
    logits = jnp.where(sampled, logits - log_w, logits)
    out, lse = masked_softmax_attention(logits, sampled | static, v)
    out, lse = nan_if_not_finite(out, lse, index, q)
    return out, lse, jnp.sum(sampled, axis=-1, dtype=jnp.int32).reshape(B, Hq)
