"""Shared shape checks and the masked softmax used by every estimator."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[int, int, int, int, int]:
    """Validate q ``[B, Hq, D]``, k and v ``[B, Hkv, N, D]`` (D >= 1); return (B, Hq, Hkv, N, D)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array (jax.Array or numpy.ndarray), got {type(x).__name__}")
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
    if D == 0:
        raise ValueError(f"the head dimension D must be >= 1, got q {tuple(q.shape)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"Hq ({Hq}) must be a multiple of Hkv ({Hkv}) for GQA")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating dtype, got {x.dtype}")
    return B, Hq, Hkv, N, D


def check_lengths(lengths: jax.Array | np.ndarray | None, B: int, N: int, name: str = "lengths") -> jax.Array:
    """Return ``lengths`` (or another per-row position, ``name``) as int32 ``[B]`` clipped to
    ``[0, N]`` (default N for every row)."""
    if lengths is None:
        return jnp.full((B,), N, dtype=jnp.int32)
    if not isinstance(lengths, jax.Array):  # host values: clip in their own width (an int64 past int32 wraps)
        lengths = np.asarray(lengths)
    if lengths.shape != (B,):
        raise ValueError(f"{name} must be [B] = [{B}], got shape {tuple(lengths.shape)}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {lengths.dtype}")
    return int32_clipped(lengths, 0, N)  # clipped first: a uint32 past int32 must not wrap


def int32_clipped(x, lo: int = 0, hi: int = 2**31 - 1, name: str = "lengths") -> jax.Array:
    """``x`` (integers) clipped to ``[lo, hi]`` in its own width, then int32: host values in NumPy, a
    narrow JAX type widened first, so neither a uint32 or int64 past int32 nor a bound past int8
    wraps (3e9 as uint32 cast first gave -1294967296).

    Raises:
      TypeError: ``x`` (``name``) is not an integer array (a float 10.7 would be cut to 10, and a
        float32 3e9 clipped to 2**31 - 1, which rounds to 2**31, wraps to -2**31).
    """
    if not isinstance(x, jax.Array):
        x = np.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {x.dtype}")
    if isinstance(x, np.ndarray):
        return jnp.asarray(np.clip(x, lo, hi).astype(np.int32))
    return jnp.clip(widened(x), lo, hi).astype(jnp.int32)


def widened(x):
    """``x`` as a JAX array, int32 if it is an integer array narrower than 32 bits (int8/int16/uint8/uint16:
    a position or page count past their range, N = 300 say, would wrap in their width: 300 -> 44)."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.integer) and x.dtype.itemsize < 4:
        return x.astype(jnp.int32)
    return x


# The soft-capping values accepted: far around Gemma 2's 50 and 30, and such that c, s / c and
# c tanh(s / c) stay normal float32 numbers (the host ops take c as a float32 attribute).
SOFTCAP_RANGE = (1e-3, 1e6)


def check_softcap(softcap, name: str = "softcap") -> float | None:
    """``softcap`` as a float, or None: it must be None or a number in :data:`SOFTCAP_RANGE`.

    Raises:
      ValueError: anything else (``name`` and the allowed values named).
    """
    if softcap is None:
        return None
    lo, hi = SOFTCAP_RANGE
    if isinstance(softcap, jax.core.Tracer):
        raise ValueError(f"{name} must be a static number (None or in [{lo:g}, {hi:g}]), got a traced value: "
                         f"under jax.jit pass it as a static argument (static_argnames=('{name}',))")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating, np.integer)) \
            or not lo <= float(softcap) <= hi:
        raise ValueError(f"{name} must be None or a number in [{lo:g}, {hi:g}], got {softcap!r}")
    return float(softcap)


def softcap_logits(logits: jax.Array, softcap: float | None) -> jax.Array:
    """Gemma 2's attention logit soft-capping: ``c * tanh(s / c)`` for a finite logit s, s itself for
    ``±inf`` and NaN (a non-finite q or k stays visible as such), identity for ``softcap=None``.

    Source: transformers' ``Gemma2Attention`` (``attn_logit_softcapping``, applied to the scaled
    ``q·k`` before the mask); the host ops compute the same (``SoftCap`` in ``host_ops/ffi_util.h``).
    """
    if softcap is None:
        return logits
    c = jnp.float32(softcap)
    return jnp.where(jnp.isfinite(logits), c * jnp.tanh(logits / c), logits)


def grouped_logits(q: jax.Array, k: jax.Array, softcap: float | None = None) -> jax.Array:
    """``q·k / sqrt(D)`` in float32, shape ``[B, Hkv, G, N]`` (query head h reads KV head h // G),
    soft-capped by :func:`softcap_logits` when ``softcap`` is set."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    qg = q.astype(jnp.float32).reshape(B, Hkv, Hq // Hkv, D)
    logits = jnp.einsum(
        "bhgd,bhnd->bhgn", qg, k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    return softcap_logits(logits / jnp.float32(math.sqrt(D)), softcap)


def selected_weighted_sum(w: jax.Array, mask: jax.Array, v: jax.Array) -> jax.Array:
    """``sum_n w[..., n] v[n]`` over the keys where ``mask`` only, float32 ``[B, Hkv, G, D]``.

    w: float ``[B, Hkv, G, N]``, zero outside ``mask``; mask: bool broadcastable to
    ``[B, Hkv, G, N]`` (a G or Hkv axis of 1 means the same keys for every head); v: ``[B, Hkv, N, D]``.

    A key outside the mask contributes nothing even when its value row is NaN or infinite
    (padding past a row's length, a key no head selected): its row is selected out, not
    multiplied by zero (``0 * NaN`` is NaN). The product ``w @ v`` over every key is computed
    first; only when it is not finite (some value row non-finite) is it recomputed with the
    unselected rows replaced by zeros (per query head where the heads select different keys).
    When every value row is finite the two give the same sum up to float32 rounding (they are
    different XLA programs, whose kernels may add in another order), so the select costs nothing
    on clean inputs.
    """
    vf = v.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    num = jnp.einsum("bhgn,bhnd->bhgd", w, vf, precision=hi)

    def selected(_):
        if mask.shape[2] == 1:  # the same keys for every query head of a KV head
            return jnp.einsum("bhgn,bhnd->bhgd", w, jnp.where(mask[:, :, 0, :, None], vf, 0.0), precision=hi)
        # one query head at a time (lax.map: one [B, Hkv, N, D] select live, an HLO loop, not G copies)
        m = jnp.broadcast_to(mask, w.shape)

        def head(args):
            wg, mg = args
            return jnp.einsum("bhn,bhnd->bhd", wg, jnp.where(mg[..., None], vf, 0.0), precision=hi)

        return jnp.moveaxis(jax.lax.map(head, (jnp.moveaxis(w, 2, 0), jnp.moveaxis(m, 2, 0))), 0, 2)

    return jax.lax.cond(jnp.all(jnp.isfinite(num)), lambda _: num, selected, None)


def masked_softmax_attention(
    logits: jax.Array, mask: jax.Array, v: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Softmax of ``logits`` over the keys where ``mask``; weighted sum of ``v``.

    logits, mask: ``[B, Hkv, G, N]`` (mask broadcastable); v: ``[B, Hkv, N, D]``.
    Returns out float32 ``[B, Hkv*G, D]`` and natural-log LSE float32 ``[B, Hkv*G]``.
    An empty mask gives ``out = 0`` and ``lse = -inf``; a NaN or +inf logit of a selected key gives
    ``out`` and ``lse`` NaN; selected keys whose logits are all -inf (a -inf in q or in every key)
    give ``out`` NaN (0/0, as ``jax.nn.softmax`` gives) and ``lse = -inf`` (their partition function
    is 0), never an empty-looking row: :func:`~magicpig_jax.attention.merge_attention` gives such a
    part weight 0 beside a non-empty one, as one softmax over the union would, and NaN beside empty
    ones. One -inf logit among finite ones weighs 0, as in a softmax. Keys outside the mask are
    selected out of the logits and of the values (:func:`selected_weighted_sum`): whatever their
    K or V rows hold (NaN, inf, garbage), they do not change the result beyond float32 rounding.
    """
    B, Hkv, G, N = logits.shape
    masked = jnp.where(mask, logits, -jnp.inf)
    m = jnp.max(masked, axis=-1, keepdims=True, initial=-jnp.inf)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(mask, jnp.exp(masked - m_safe), 0.0)
    s = jnp.sum(e, axis=-1)
    num = selected_weighted_sum(e, mask, v)
    out = num / jnp.where(s > 0, s, 1.0)[..., None]
    lse = jnp.where(s > 0, m_safe[..., 0] + jnp.log(jnp.where(s > 0, s, 1.0)), -jnp.inf)
    # A NaN or +inf logit of a selected key: NaN; selected keys whose logits are all -inf: out NaN and
    # lse -inf (merge_attention weighs it 0 beside a non-empty part), not "empty"
    only_minus_inf = (s == 0) & jnp.any(jnp.broadcast_to(mask, logits.shape), axis=-1)
    lse = jnp.where(jnp.isfinite(s), lse, jnp.nan)
    out = jnp.where(only_minus_inf[..., None], jnp.nan, out)
    return out.reshape(B, Hkv * G, v.shape[-1]), lse.reshape(B, Hkv * G)


def valid_mask(lengths: jax.Array, N: int) -> jax.Array:
    """``[B, 1, 1, N]`` bool: key position < lengths[b]."""
    return (jnp.arange(N, dtype=jnp.int32)[None, :] < lengths[:, None])[:, None, None, :]
