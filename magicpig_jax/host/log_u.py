"""The float64 ``log u`` table of the sampled-attention kernel, its exact form, and a test hook.

A key that collides with the query in >= 2 of L tables of K bits is sampled with
probability ``u = 1 - (1 - p^K)^L - L p^K (1 - p^K)^(L-1)``, ``p = 1 - arccos(cos)/pi``
(arXiv 2410.16179, Eq. (9)); its logit is corrected by ``-log u``. The kernels evaluate
``log u = max(2K log p + f(p), LOG_U_FLOOR)`` with ``f = log(u / p^(2K))`` tabulated in float64
on ``T + 1`` points of ``[0, 1]`` (:func:`log_u_table`, ``T`` = :func:`table_size`, ``2^14`` at the
paper's K and L) and interpolated linearly (on AVX2,
8 candidates at a time with polynomial arccos and log). ``f`` is smooth on ``[0, 1]`` because
``u / P^2`` is a positive polynomial in ``P = p^K``; its accuracy against the exact form
(:func:`log_u_exact`) is tested through :func:`host_log_u`.

Internal API of the host package: :func:`table_operand` (the table as an op operand).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from magicpig_jax import lsh
from magicpig_jax.attention.magicpig import LOG_U_FLOOR
from magicpig_jax.host._ext import impl_code, ops
from magicpig_jax.host.index import HOST_MAX_K

__all__ = ["LOG_U_TABLE_SIZE", "table_size", "log_u_table", "log_u_exact", "host_log_u", "table_operand"]

LOG_U_TABLE_SIZE = 1 << 14


def table_size(K: int, L: int) -> int:
    """``T``, the intervals of the kernel's table for (K, L): ``LOG_U_TABLE_SIZE`` or a larger power of 2.

    ``f`` bends where ``L p^K ~ 1``, around ``p* = L^(-1/K)``, over a width of about ``p* / K``;
    the error of the linear interpolation grows as ``(1 / (T * width))^2``. ``T >= 128 K L^(1/K)``
    keeps 128 intervals across that width: 2^14 at K = 10, L = 150, but 2^17 at K = 1, L = 1000
    (where 2^14 intervals would leave too few across the bend for the tests' bound on ``log u``).
    """
    need = 128 * K * L ** (1.0 / K)
    size = LOG_U_TABLE_SIZE
    while size < need:
        size *= 2
    return size


def _log_u_f64(p: np.ndarray, K: int, L: int) -> tuple[np.ndarray, np.ndarray]:
    """``(log u, f = log u - 2K log p)`` in float64 (arXiv 2410.16179, Eq. (9)).

    For ``L p^K < 0.05`` a series avoids the cancellation of the closed form:
    ``u / P^2 = C(L,2) (1-P)^(L-2) sum_m c_m r^m``, ``r = P/(1-P)``, ``c_m = C(L,m+2)/C(L,2)``.
    """
    p = np.clip(np.asarray(p, np.float64), 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_p = np.log(p)
        P = np.exp(K * log_p)
        small = L * P < 0.05
        Ps = np.minimum(P, 0.05 / L)
        r = Ps / (1.0 - Ps)
        term = np.ones_like(Ps)
        total = np.ones_like(Ps)
        for m in range(1, 40):
            term = term * r * (max(L - m - 1, 0) / (m + 2))
            total = total + term
        f_series = math.log(L * (L - 1) / 2.0) + (L - 2) * np.log1p(-Ps) + np.log(total)
        Pc = np.minimum(P, 1.0 - 1e-16)
        l1 = np.log1p(-Pc)
        u = -np.expm1(L * l1) - L * Pc * np.exp((L - 1) * l1)
        log_closed = np.where(P >= 1.0, 0.0, np.log(np.maximum(u, 1e-300)))
        f_closed = log_closed - 2.0 * K * log_p
        f = np.where(small, f_series, f_closed)
        log_u = np.where(small, f_series + 2.0 * K * log_p, log_closed)
    return log_u, f


@functools.lru_cache(maxsize=64)
def _log_u_table_np(K: int, L: int, size: int) -> np.ndarray:
    p = np.arange(size + 1, dtype=np.float64) / size
    _, f = _log_u_f64(p, K, L)
    return f


def log_u_table(K: int, L: int, size: int = LOG_U_TABLE_SIZE) -> np.ndarray:
    """float64 ``[size + 1]``: ``f(p) = log(u / p^(2K))`` at ``p = i / size`` (``f(0)`` = its limit).

    The kernels evaluate ``log u = max(2K log p + f(p), LOG_U_FLOOR)`` with ``f``
    linearly interpolated. ``f`` is smooth on ``[0, 1]`` because ``u / P^2`` is a
    positive polynomial in ``P = p^K``. The array is cached: do not modify it.

    Raises:
      TypeError / ValueError: bad ``K`` or ``L`` (:func:`magicpig_jax.lsh.validate_k_l`).

    Source: arXiv 2410.16179, Eq. (9) (``u = 1 - (1 - p^K)^L - L p^K (1 - p^K)^(L-1)``).
    """
    lsh.validate_k_l(K, L)
    return _log_u_table_np(K, L, size)


def log_u_exact(cos: np.ndarray, K: int, L: int) -> np.ndarray:
    """Exact (float64) ``log u`` of cosines, floored at ``LOG_U_FLOOR`` (the tests' yardstick).

    Args:
      cos: cosines of any shape, clipped to ``[-1, 1]``.
      K, L: the LSH parameters.

    Returns:
      float64 ``log u`` (natural log), same shape as ``cos``.

    Raises:
      TypeError / ValueError: bad ``K`` or ``L`` (:func:`magicpig_jax.lsh.validate_k_l`).

    Source: arXiv 2410.16179, Eq. (9), with ``p = 1 - arccos(cos) / pi`` (Section 4.2).
    """
    lsh.validate_k_l(K, L)
    c = np.clip(np.asarray(cos, np.float64), -1.0, 1.0)
    p = 1.0 - np.arccos(c) / math.pi
    log_u, _ = _log_u_f64(p, K, L)
    return np.maximum(np.where(p > 0, log_u, -np.inf), LOG_U_FLOOR)


def table_operand(K: int, L: int) -> jax.Array:
    """The float64 table of :func:`log_u_table` with :func:`table_size` intervals as uint32
    ``[T + 1, 2]`` (its raw bits), the operand the ops read (they take T from its shape), so JAX's
    x64 mode is not needed."""
    return jnp.asarray(log_u_table(K, L, table_size(K, L)).view(np.uint32).reshape(-1, 2))


def host_log_u(cos: Float[Array, "..."], K: int, L: int, impl: str = "auto") -> Float[Array, "..."]:
    """``log u`` of cosines through the C++ kernel's table interpolation (for tests).

    Args:
      cos: float32 cosines of any shape, clipped to [-1, 1].
      K, L: the LSH parameters (``1 <= K <= 16``).
      impl: ``"auto"``, ``"scalar"`` or ``"avx2"`` (the vectorized batch the attention
        kernel uses on AVX2 CPUs: A&S 4.4.46 arccos and Cephes' logf polynomial).

    Returns:
      float32 ``log u`` (natural log), floored at ``LOG_U_FLOOR``; same shape as ``cos``.

    Raises:
      TypeError: K or L not an int.
      ValueError: bad K, L or impl.
      ImportError: the native extension is not built.

    Source: arXiv 2410.16179, Eq. (9).
    """
    lsh.validate_k_l(K, L)
    code = impl_code(impl)
    if not 1 <= K <= HOST_MAX_K:
        raise ValueError(f"K must be in [1, {HOST_MAX_K}] for the host op, got K={K}")
    ops()
    cos = jnp.asarray(cos, jnp.float32)
    return jax.ffi.ffi_call(
        "magicpig_host_log_u", jax.ShapeDtypeStruct(cos.shape, jnp.float32), vmap_method="sequential"
    )(cos, table_operand(K, L), K=np.int64(K), impl=np.int64(code))
