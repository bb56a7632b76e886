"""SimHash locality-sensitive hashing and the MagicPIG sampling probability.

Shape glossary (used throughout ``magicpig_jax``): B batch rows, Hq query heads,
Hkv KV heads, G = Hq / Hkv query heads per KV head (GQA), N cached keys, D head
dimension, K bits per hash table, L hash tables.

Source: Chen et al., "MagicPIG: LSH Sampling for Efficient LLM Generation",
ICLR 2025, arXiv 2410.16179, Section 4.2 (SimHash, "collides in at least 2 of
L tables") and the sampling probability of Eq. (9)/(10) there.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt32

__all__ = [
    "simhash_projections",
    "simhash_codes",
    "exponent_scaled",
    "cosine_from_dots",
    "collision_probability",
    "collision_probability_from_cosine",
    "sampling_probability",
    "log_sampling_probability",
    "validate_k_l",
    "check_prng_key",
]

MAX_K = 32
MAX_L = 2**16  # tables: codes are [.., L] and the hyperplanes [D, K*L]; the paper uses a few hundred

# Below this value of L * p^K the closed form of u cancels in float32 (at L * p^K >= 1,
# u >= 1/4: 1/4 at L = 2, rising toward 1 - 2/e ~ 0.264 as L grows at L * p^K = 1; the
# cancellation costs ~5e-7 relative), and
# the series around p^K = 0 is used; with L * p^K < 1 its m-th term is at most
# 2 * 2^m / (m + 2)!, so 20 terms leave a truncation error < 1e-14 relative.
_SERIES_THRESHOLD = 1.0
_SERIES_TERMS = 20


def validate_k_l(K: int, L: int) -> None:
    """Check the LSH parameters.

    Args:
      K: bits per table, an ``int`` in ``[1, 32]`` (codes are ``uint32``).
      L: number of tables, an ``int`` in ``[2, MAX_L]`` (a key is sampled when it collides
        with the query in at least 2 tables, so L = 1 could never sample; ``MAX_L = 65536``
        bounds the hyperplanes ``[D, K·L]`` and the codes before they are allocated).

    Raises:
      TypeError: if K or L is not an integer.
      ValueError: if K or L is out of range.

    Source: arXiv 2410.16179, Section 4.2 (K bits per table, L tables, "collides in >= 2 tables").
    """
    for name, value in (("K", K), ("L", L)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not 1 <= K <= MAX_K:
        raise ValueError(f"K must be in [1, {MAX_K}] (bits per uint32 code), got K={K}")
    if L < 2:
        raise ValueError(f"L must be >= 2 (sampling needs >= 2 colliding tables), got L={L}")
    if L > MAX_L:
        raise ValueError(f"L must be <= {MAX_L} (tables of codes and [D, K*L] hyperplanes), got L={L}")


def check_prng_key(name: str, key) -> None:
    """Refuse a ``key`` that is not one ``jax.random`` key: a typed key of shape ``()``, or a raw
    1-D ``uint32`` key (``[2]`` for threefry, ``[4]`` for rbg; JAX's own errors, such as 'invalid
    PRNG key data', name no argument).

    Raises:
      TypeError: as described, naming ``name``.
    """
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and shape == ():
        return
    # a raw key has the active implementation's shape: [2] for threefry, [4] for rbg
    if dtype == jnp.uint32 and shape == jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape:
        return
    raise TypeError(f"{name} must be one jax.random key (jax.random.key(seed), or a raw uint32 "
                    f"jax.random.PRNGKey(seed)), got {type(key).__name__}"
                    + (f" of dtype {dtype} and shape {tuple(shape)}" if shape is not None else ""))


def simhash_projections(key: jax.Array, head_dim: int, K: int, L: int) -> Float[Array, "D KL"]:
    """Draw the Gaussian hyperplanes of K-bit SimHash in L tables.

    Args:
      key: a ``jax.random`` key.
      head_dim: D, the vector dimension (> 0).
      K: bits per table, 1..32.
      L: tables, >= 2.

    Returns:
      float32 ``[D, K*L]``; table ``l`` uses columns ``l*K .. l*K + K - 1`` and
      bit ``j`` of table ``l`` is column ``l*K + j``.

    Raises:
      ValueError / TypeError: for an invalid ``head_dim``, ``K`` or ``L``; TypeError: ``key`` is not
        one ``jax.random`` key.

    Source: arXiv 2410.16179, Section 4.2 (SimHash, Charikar 2002).
    """
    validate_k_l(K, L)
    check_prng_key("key", key)
    if isinstance(head_dim, (bool, np.bool_)) or not isinstance(head_dim, (int, np.integer)):
        raise TypeError(f"head_dim must be an int, got {type(head_dim).__name__} {head_dim!r}")
    if head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    return jax.random.normal(key, (int(head_dim), K * L), dtype=jnp.float32)


def simhash_codes(
    x: Float[Array, "... D"], projections: Float[Array, "D KL"], K: int, L: int
) -> UInt32[Array, "... L"]:
    """SimHash codes of vectors, one K-bit code per table.

    Bit ``j`` of the code of table ``l`` is 1 iff ``x · projections[:, l*K + j] > 0``.
    Convention: a projection that is exactly zero (for example the zero vector)
    gives bit 0. Every path of the library (pure JAX and the host op) hashes with
    this function, so the convention is shared bit for bit. Each vector is first
    scaled by a power of two (:func:`exponent_scaled`), which keeps every sign: without
    it, a vector of norm near 1e-38 had products below float32's normal range, which
    XLA's CPU backend flushes to zero (bit 0), while its sampling probability ``u`` is
    computed from the scaled vector; the two then described different samplers (a
    biased estimate). A vector too large for float32 products no longer overflows.

    Args:
      x: ``[..., D]`` float array (any float dtype; projected in float32).
      projections: float32 ``[D, K*L]`` from :func:`simhash_projections`.
      K: bits per table, 1..32.
      L: tables, >= 2.

    Returns:
      uint32 ``[..., L]``.

    Raises:
      ValueError: if ``projections`` is not ``[D, K*L]`` with D = ``x.shape[-1]``, or D = 0.
      TypeError: ``x`` is not a float array of at least one dimension, or ``projections`` is not a
        float array (integer hyperplanes are not SimHash's Gaussian ones, so the sampling
        probabilities would not hold); either is not an array.

    Source: arXiv 2410.16179, Section 4.2.
    """
    validate_k_l(K, L)
    for name, a in (("x", x), ("projections", projections)):
        if not hasattr(a, "dtype") or not hasattr(a, "shape"):
            raise TypeError(f"{name} must be an array (jax or NumPy), got {type(a).__name__}")
    if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a float array [..., D] (vectors to hash), got {x.dtype} of shape "
                        f"{tuple(x.shape)}")
    if x.shape[-1] == 0:
        raise ValueError("x must have D >= 1 (a vector of no coordinates has no direction to hash)")
    if not jnp.issubdtype(projections.dtype, jnp.floating):
        raise TypeError(f"projections must be a float array (Gaussian SimHash hyperplanes), got {projections.dtype}")
    if projections.ndim != 2 or projections.shape != (x.shape[-1], K * L):
        raise ValueError(
            f"projections must have shape [D, K*L] = [{x.shape[-1]}, {K * L}], "
            f"got {tuple(projections.shape)}"
        )
    proj = jnp.matmul(
        exponent_scaled(x), projections.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    bits = (proj > 0).reshape(*proj.shape[:-1], L, K).astype(jnp.uint32)
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(K, dtype=jnp.uint32))
    weights = weights.reshape((1,) * (bits.ndim - 1) + (K,))  # explicit rank (no implicit promotion)
    return jnp.sum(bits * weights, axis=-1, dtype=jnp.uint32)


def exponent_scaled(x: Float[Array, "... D"]) -> Float[Array, "... D"]:
    """``x`` in float32, each vector (last axis) times the power of two that brings its largest
    absolute entry into ``[1, 2)``; a zero vector stays zero.

    The scaling is exact (a power of two), so a cosine computed from scaled vectors equals the
    unscaled one wherever that did not under- or overflow, and the squared norms can no longer
    underflow (tiny vectors read as zero) or overflow (huge ones gave NaN) in float32.

    Args:
      x: float ``[..., D]``.

    Returns:
      float32 ``[..., D]``; a vector with a non-finite entry is returned unscaled.
    """
    x = jnp.asarray(x).astype(jnp.float32)
    top = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    ok = (top > 0) & jnp.isfinite(top)
    _, e = jnp.frexp(jnp.where(ok, top, 1.0))  # top = m 2^e, m in [0.5, 1)
    return jnp.where(ok, jnp.ldexp(x, 1 - e), x)


def cosine_from_dots(dots: Float[Array, "..."], q_scaled: Float[Array, "... D"],
                     k_scaled: Float[Array, "... D"]) -> Float[Array, "..."]:
    """``dots / (||q|| ||k||)``, 0 where either norm is 0 (the angle is undefined).

    Args:
      dots: float32, the dot products of the :func:`exponent_scaled` vectors.
      q_scaled, k_scaled: those vectors, broadcast against ``dots`` once their last axis is
        reduced to the norm.

    Returns:
      float32, the shape of ``dots``; NaN where an input is not finite.
    """
    norms = _norm(q_scaled) * _norm(k_scaled)
    return jnp.where(norms > 0, dots / jnp.where(norms > 0, norms, 1.0), 0.0)


def _norm(x: Float[Array, "... D"]) -> Float[Array, "..."]:
    """``jnp.linalg.norm(x, axis=-1)`` with a zero gradient at a zero vector (the norm's own
    is 0/0 = NaN there, and ``jnp.where`` does not mask a NaN cotangent of its untaken branch)."""
    nonzero = jnp.any(x != 0, axis=-1, keepdims=True)
    return jnp.where(nonzero[..., 0], jnp.linalg.norm(jnp.where(nonzero, x, 1.0), axis=-1), 0.0)


def collision_probability(q: Float[Array, "... D"], k: Float[Array, "... D"]) -> Float[Array, "..."]:
    """Per-bit SimHash collision probability ``p = 1 - arccos(cos(q, k)) / pi``.

    The cosine is computed in float32 from the :func:`exponent_scaled` vectors (any finite
    norm), clamped to ``[-1, 1]`` before ``arccos``. Convention: if either
    vector is zero the angle is undefined and ``cos`` is taken as 0, so ``p = 1/2``.

    Args:
      q, k: float arrays broadcastable to a common ``[..., D]``.

    Returns:
      float32 ``[...]`` in ``[0, 1]``; NaN only where an input entry is not finite.

    Raises:
      ValueError: ``q`` and ``k`` have different last dimensions D, D = 0, or do not broadcast.
      TypeError: ``q`` or ``k`` is complex or boolean (the cast to float32 would drop the imaginary
        part; integer inputs are exact and accepted).

    Source: arXiv 2410.16179, Section 4.2 (Goemans-Williamson / Charikar).
    """
    q, k = jnp.asarray(q), jnp.asarray(k)
    for name, x in (("q", q), ("k", k)):
        if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
            raise TypeError(f"collision_probability: {name} must be a real float or integer array, got {x.dtype}")
    if q.ndim == 0 or k.ndim == 0 or q.shape[-1] != k.shape[-1] or q.shape[-1] == 0:
        raise ValueError(f"q and k must be [..., D] with the same D >= 1, got shapes {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    try:
        jnp.broadcast_shapes(q.shape, k.shape)
    except ValueError:
        raise ValueError(f"q and k must broadcast, got shapes {tuple(q.shape)} and {tuple(k.shape)}") from None
    qs, ks = exponent_scaled(q), exponent_scaled(k)
    return collision_probability_from_cosine(cosine_from_dots(jnp.sum(qs * ks, axis=-1), qs, ks))


def collision_probability_from_cosine(cos: Float[Array, "..."]) -> Float[Array, "..."]:
    """``p = 1 - arccos(clip(cos, -1, 1)) / pi`` in float32 (see :func:`collision_probability`),
    computed as ``arccos(-cos) / pi`` (the angle to ``-k``): near ``cos = -1``, where ``p`` is
    small, ``1 - arccos(cos) / pi`` cancelled (6e-4 relative error at ``cos = -0.99999994``); the
    host op's ``LogU`` takes the same form.

    Differentiable: at ``cos = ±1`` (and beyond, clipped) the gradient is 0 instead of arccos's
    infinite slope (the angle has a kink there, like ``|x|`` at 0), so a gradient through it is
    finite; NaN stays NaN.

    Limit: a float32 cosine cannot tell apart angles within about 3.5e-4 rad of 0 or of pi (its
    spacing below 1 is 6e-8, and ``1 - cos ~ angle^2 / 2``): a centered key that close to
    antiparallel to the query gets ``p = 0`` (``log u`` at its floor, ``log 1e-30``) where the true
    ``u`` may be larger, so if it is sampled its weight is too large; such a key collides in two
    tables with probability ``u``, far below 1e-8 there. Keys of real models are not that close.
    """
    cos = jnp.asarray(cos, jnp.float32)
    inside = jnp.abs(cos) < 1.0
    edge = jnp.where(cos >= 1.0, 1.0, jnp.where(cos <= -1.0, 0.0, cos))  # NaN stays NaN
    return jnp.where(inside, jnp.arccos(jnp.where(inside, -cos, 0.0)) / jnp.float32(math.pi), edge)


def log_sampling_probability(p: Float[Array, "..."], K: int, L: int) -> Float[Array, "..."]:
    """``log u``: natural log of the probability that a key is sampled.

    ``u = P[X >= 2]``, ``X ~ Binomial(L, P)``, ``P = p^K``, i.e.
    ``u = 1 - (1-P)^L - L P (1-P)^(L-1)`` (arXiv 2410.16179, Section 4.2,
    "collides in at least 2 of L tables").

    Computed stably in float32: for ``L*P >= 1`` the closed form (then ``u >= 1/4``,
    the value at ``L = 2, P = 1/2``; at ``L*P = 1`` it rises toward ``1 - 2/e ~ 0.264`` as
    ``L`` grows; cancellation costs < 1e-6 relative); below, the series
    ``log C(L,2) + 2 log P + (L-2) log1p(-P) + log sum_m c_m r^m``,
    ``r = P/(1-P)``, ``c_m = C(L, m+2)/C(L, 2)``, which has no cancellation.
    Relative error of ``u`` against float64 stays below 1e-4 (the tests' bound) wherever
    the true ``u >= 1e-30`` (``tests/test_lsh.py``, over K in 1..32, L in 2..5000); ``log u``
    is finite for ``p >= 1.2e-38`` (the smallest normal float32) and ``-inf`` for ``p = 0``
    and for subnormal ``p``, which XLA's CPU backend flushes to zero (a ``p`` computed from a
    cosine is never that small); NaN only for a NaN ``p``.

    Args:
      p: collision probability per bit, any shape, values in ``[0, 1]``
        (clipped into it).
      K: bits per table, 1..32.
      L: tables, >= 2.

    Returns:
      float32, same shape as ``p``.

    Raises:
      ValueError / TypeError: invalid K or L.
    """
    validate_k_l(K, L)
    p = jnp.clip(jnp.asarray(p, jnp.float32), 0.0, 1.0)
    log_p = jnp.log(p)
    log_P = K * log_p  # -inf for p = 0
    P = jnp.exp(log_P)
    # Closed form, used where L * P is not small.
    P_safe = jnp.minimum(P, 1.0)
    log1m = jnp.log1p(-jnp.minimum(P_safe, 1.0 - 1e-7))
    none = jnp.exp(L * log1m)
    one = L * P_safe * jnp.exp((L - 1) * log1m)
    closed = jnp.where(P_safe >= 1.0, 1.0, 1.0 - none - one)
    log_closed = jnp.log(jnp.maximum(closed, jnp.finfo(jnp.float32).tiny))
    # Series for small L * P.
    P_small = jnp.minimum(P, _SERIES_THRESHOLD / L)
    r = P_small / (1.0 - P_small)
    term = jnp.ones_like(P_small)
    total = jnp.ones_like(P_small)
    for m in range(1, _SERIES_TERMS):
        term = term * r * (max(L - m - 1, 0) / (m + 2))
        total = total + term
    log_series = (
        math.log(L * (L - 1) / 2.0)
        + 2.0 * log_P
        + (L - 2) * jnp.log1p(-P_small)
        + jnp.log(total)
    )
    return jnp.where(L * P < _SERIES_THRESHOLD, log_series, log_closed)


def sampling_probability(p: Float[Array, "..."], K: int, L: int) -> Float[Array, "..."]:
    """``u = 1 - (1-p^K)^L - L p^K (1-p^K)^(L-1)``, the probability that a key is sampled.

    ``exp`` of :func:`log_sampling_probability` (same stability guarantees;
    underflows to 0 only below float32's range, about 1e-45).

    Args:
      p: collision probability per bit, values in ``[0, 1]``.
      K: bits per table, 1..32.
      L: tables, >= 2.

    Returns:
      float32, same shape as ``p``, in ``[0, 1]``.

    Raises:
      ValueError / TypeError: invalid K or L (:func:`validate_k_l`).

    Source: arXiv 2410.16179, Section 4.2.
    """
    return jnp.exp(log_sampling_probability(p, K, L))
