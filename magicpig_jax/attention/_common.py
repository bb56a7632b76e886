"""Shared shape checks and the masked softmax used by every estimator."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[int, int, int, int, int]:
    """Validate q ``[B, Hq, D]``, k and v ``[B, Hkv, N, D]``; return (B, Hq, Hkv, N, D)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    if k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"k and v must be [B, Hkv, N, D], got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    B, Hq, D = q.shape
    Bk, Hkv, N, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on B or D")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"Hq ({Hq}) must be a multiple of Hkv ({Hkv}) for GQA")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating dtype, got {x.dtype}")
    return B, Hq, Hkv, N, D


def check_lengths(lengths: jax.Array | None, B: int, N: int) -> jax.Array:
    """Return ``lengths`` as int32 ``[B]`` (default N for every row)."""
    if lengths is None:
        return jnp.full((B,), N, dtype=jnp.int32)
    lengths = jnp.asarray(lengths)
    if lengths.shape != (B,):
        raise ValueError(f"lengths must be [B] = [{B}], got shape {tuple(lengths.shape)}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"lengths must be an integer array, got {lengths.dtype}")
    return jnp.clip(lengths.astype(jnp.int32), 0, N)


def grouped_logits(q: jax.Array, k: jax.Array) -> jax.Array:
    """``q·k / sqrt(D)`` in float32, shape ``[B, Hkv, G, N]`` (query head h reads KV head h // G)."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    qg = q.astype(jnp.float32).reshape(B, Hkv, Hq // Hkv, D)
    logits = jnp.einsum(
        "bhgd,bhnd->bhgn", qg, k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    return logits / jnp.float32(math.sqrt(D))


def masked_softmax_attention(
    logits: jax.Array, mask: jax.Array, v: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Softmax of ``logits`` over the keys where ``mask``; weighted sum of ``v``.

    logits, mask: ``[B, Hkv, G, N]``; v: ``[B, Hkv, N, D]``.
    Returns out float32 ``[B, Hkv*G, D]`` and natural-log LSE float32 ``[B, Hkv*G]``.
    An empty mask gives ``out = 0`` and ``lse = -inf`` (never NaN).
    """
    B, Hkv, G, N = logits.shape
    masked = jnp.where(mask, logits, -jnp.inf)
    m = jnp.max(masked, axis=-1, keepdims=True, initial=-jnp.inf)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(mask, jnp.exp(masked - m_safe), 0.0)
    s = jnp.sum(e, axis=-1)
    num = jnp.einsum(
        "bhgn,bhnd->bhgd", e, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    out = num / jnp.where(s > 0, s, 1.0)[..., None]
    lse = jnp.where(s > 0, m_safe[..., 0] + jnp.log(jnp.where(s > 0, s, 1.0)), -jnp.inf)
    return out.reshape(B, Hkv * G, -1), lse.reshape(B, Hkv * G)


def valid_mask(lengths: jax.Array, N: int) -> jax.Array:
    """``[B, 1, 1, N]`` bool: key position < lengths[b]."""
    return (jnp.arange(N, dtype=jnp.int32)[None, :] < lengths[:, None])[:, None, None, :]
