"""Exact (dense) decode attention: the reference every estimator is measured against."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from magicpig_jax.attention._common import (
    check_lengths,
    check_qkv,
    check_softcap,
    grouped_logits,
    masked_softmax_attention,
    valid_mask,
)

__all__ = ["dense_attention"]


def dense_attention(
    q: Float[Array, "B Hq D"],
    k: Float[Array, "B Hkv N D"],
    v: Float[Array, "B Hkv N D"],
    lengths: Int[Array, " B"] | None = None,
    starts: Int[Array, " B"] | None = None,
    *,
    softcap: float | None = None,
) -> tuple[Float[Array, "B Hq D"], Float[Array, "B Hq"]]:
    """Exact softmax attention of one decode step, with GQA.

    ``o = softmax(q K^T / sqrt(D)) V`` over the keys ``starts[b] <= j < lengths[b]`` of row b
    (arXiv 2410.16179, Section 2, Eq. (1)). Query head h reads KV head
    ``h // (Hq // Hkv)``. Computed in float32 whatever the input dtype. ``starts`` is the
    first key a sliding-window layer still sees (Mistral's ``sliding_window``: a query at
    position p attends to positions ``p - W + 1 .. p``).

    Args:
      q: ``[B, Hq, D]`` float.
      k, v: ``[B, Hkv, N, D]`` float.
      lengths: int ``[B]``, valid keys per row (default N; clipped to [0, N]); the K and
        V rows past them are never used (NaN there leaves the result unchanged).
      starts: int ``[B]``, the first valid key per row (default 0; clipped to [0, N]); keys
        before it are never used, as those past ``lengths``.
      softcap: None, or c in [0.001, 1e6]: each logit s becomes ``c * tanh(s / c)`` (Gemma 2's
        ``attn_logit_softcapping``, :func:`~magicpig_jax.attention._common.softcap_logits`).

    Returns:
      ``(out, lse)``: out float32 ``[B, Hq, D]``; lse float32 ``[B, Hq]``, the
      natural-log log-sum-exp of the logits. A row with no valid key gives
      ``out = 0``, ``lse = -inf``.

    Raises:
      ValueError: mismatched shapes, Hq not a multiple of Hkv, or a softcap out of [0.001, 1e6].
      TypeError: non-float q/k/v or non-integer lengths.
    """
    softcap = check_softcap(softcap)
    B, _, _, N, _ = check_qkv(q, k, v)
    lengths = check_lengths(lengths, B, N)
    mask = valid_mask(lengths, N)
    if starts is not None:
        starts = check_lengths(starts, B, N, name="starts")
        mask = mask & (jnp.arange(N, dtype=jnp.int32)[None, :] >= starts[:, None])[:, None, None, :]
    logits = grouped_logits(q, k, softcap)
    return masked_softmax_attention(logits, mask, v)


