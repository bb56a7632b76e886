"""Exact attention over the static set: the sink tokens and the unhashed tail.

Every sparse method keeps some keys exactly (arXiv 2410.16179, Section 5): the first
``num_sink`` tokens, the local window of the prompt, and the generated tokens not yet
moved into the sampled set. With the hashed range ``[start, end)`` of
:meth:`MagicPIGConfig.hashed_range`, these are ``[0, start)`` and ``[end, length)``.
This module is the one implementation of that part; each sparse backend merges it with
its estimate of the middle range through :func:`merge_attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from magicpig_jax.attention._common import (
    check_lengths,
    check_qkv,
    check_softcap,
    grouped_logits,
    masked_softmax_attention,
)
from magicpig_jax.attention.merge import merge_attention

__all__ = ["static_attention"]


def static_attention(
    q: Float[Array, "B Hq D"],
    k: Float[Array, "B Hkv N D"],
    v: Float[Array, "B Hkv N D"],
    start: Int[Array, " B"],
    end: Int[Array, " B"],
    lengths: Int[Array, " B"],
    *,
    num_sink: int,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[Float[Array, "B Hq D"], Float[Array, "B Hq"]]:
    """Exact softmax attention over the static keys: the sinks ``[0, min(start, num_sink))`` and the
    tail ``[max(end, lengths - window), lengths)``.

    With ``window=None`` the whole tail ``[end, lengths)`` is attended, through a mask over
    all N positions (no copy of the cache). With an int ``window`` W only the last W
    positions are read (a slice of the sinks and a slice of W positions per row), so the cost
    does not grow with N; the caller attends the keys of ``[end, lengths - W)``, if any,
    elsewhere (the host op does).

    Args:
      q: float ``[B, Hq, D]``.
      k, v: float ``[B, Hkv, N, D]``.
      start: int ``[B]``, ``0 <= start <= lengths``: the sinks are ``[0, min(start, num_sink))``.
      end: int ``[B]``, ``start <= end``: the tail starts here.
      lengths: int ``[B]`` valid keys per row, in ``[0, N]``.
      (Values out of these ranges are clipped into them, ``end`` to at least ``start``: under
      ``jit`` they cannot be checked, and both paths then give the same answer.)
      num_sink: static bound on the sinks, ``>= 0``: they are read from the first ``num_sink``
        positions (with or without ``window``), so ``start`` beyond it counts as ``num_sink``.
      window: static int ``>= 0`` or None (see above).
      softcap: None, or c in [0.001, 1e6]: logits soft-capped to ``c * tanh(s / c)`` (Gemma 2).

    Returns:
      ``(out, lse)``: out float32 ``[B, Hq, D]``, natural-log LSE float32 ``[B, Hq]``;
      out 0 and lse ``-inf`` for a row with no static key.

    Raises:
      ValueError: bad shapes (``start``, ``end`` or ``lengths`` not ``[B]``), a negative
        ``num_sink`` or ``window``, a softcap out of [0.001, 1e6].
      TypeError: ``start``, ``end`` or ``lengths`` not integers, ``num_sink`` or ``window``
        not a Python or NumPy int (named).

    Source: arXiv 2410.16179, Section 5 (the static set) and Eq. (4) (the parts merged by LSE).
    """
    B, Hq, Hkv, N, D = check_qkv(q, k, v)
    softcap = check_softcap(softcap)
    for name, value in (("num_sink", num_sink), ("window", window)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | np.integer)):
            raise TypeError(f"{name} must be a static int, got {value!r}")
    if num_sink is None:
        raise TypeError("num_sink must be a static int, got None")
    if num_sink < 0:
        raise ValueError(f"num_sink must be >= 0, got num_sink={num_sink}")
    if window is not None and window < 0:
        raise ValueError(f"window must be >= 0 or None, got window={window}")
    lengths = check_lengths(lengths, B, N)  # [B] integers (TypeError / ValueError naming them), clipped to [0, N]
    start = check_lengths(start, B, N, name="start")
    end = check_lengths(end, B, N, name="end")
    pos = jnp.arange(N, dtype=jnp.int32)[None, :]
    # Both paths read the sinks from the first num_sink positions, and the tail from max(end, start):
    # out-of-range values (traced ones cannot raise) give the same answer on either path.
    start = jnp.minimum(jnp.minimum(start, min(int(num_sink), N)), lengths)  # min: an int32 (2**31 overflowed)
    end = jnp.maximum(end, start)
    if window is None:
        mask = (pos < start[:, None]) | ((pos >= end[:, None]) & (pos < lengths[:, None]))
        return masked_softmax_attention(grouped_logits(q, k, softcap), mask[:, None, None, :], v)
    out = jnp.zeros((B, Hq, D), jnp.float32)
    lse = jnp.full((B, Hq), -jnp.inf, jnp.float32)
    ns = min(num_sink, N)
    if ns > 0:
        sink = pos[:, :ns] < start[:, None]
        o_s, l_s = masked_softmax_attention(grouped_logits(q, k[:, :, :ns], softcap), sink[:, None, None, :],
                                            v[:, :, :ns])
        out, lse = merge_attention(out, lse, o_s, l_s)
    W = min(window, N)
    if W > 0:
        # One contiguous slice of W positions per row, starting at s = clip(len - W, 0, N - W).
        s = jnp.clip(lengths - W, 0, N - W)
        kt = jax.vmap(lambda x, st: jax.lax.dynamic_slice_in_dim(x, st, W, axis=1))(k, s)
        vt = jax.vmap(lambda x, st: jax.lax.dynamic_slice_in_dim(x, st, W, axis=1))(v, s)
        j = pos[:, :W] + s[:, None]
        tail = (j >= jnp.maximum(end, lengths - W)[:, None]) & (j < lengths[:, None])
        o_t, l_t = masked_softmax_attention(grouped_logits(q, kt, softcap), tail[:, None, None, :], vt)
        out, lse = merge_attention(out, lse, o_t, l_t)
    return out, lse
