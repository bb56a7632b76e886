"""Exact (dense) decode attention: the reference every estimator is measured against."""

from __future__ import annotations

from jaxtyping import Array, Float, Int

from magicpig_jax.attention._common import (
    check_lengths,
    check_qkv,
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
) -> tuple[Float[Array, "B Hq D"], Float[Array, "B Hq"]]:
    """Exact softmax attention of one decode step, with GQA.

    ``o = softmax(q K^T / sqrt(D)) V`` over the first ``lengths[b]`` keys of row b
    (arXiv 2410.16179, Section 2, Eq. (1)). Query head h reads KV head
    ``h // (Hq // Hkv)``. Computed in float32 whatever the input dtype.

    Args:
      q: ``[B, Hq, D]`` float.
      k, v: ``[B, Hkv, N, D]`` float.
      lengths: int ``[B]``, valid keys per row (default N; clipped to [0, N]); the K and
        V rows past them are never used (NaN there leaves the result unchanged).

    Returns:
      ``(out, lse)``: out float32 ``[B, Hq, D]``; lse float32 ``[B, Hq]``, the
      natural-log log-sum-exp of the logits. A row with no valid key gives
      ``out = 0``, ``lse = -inf``.

    Raises:
      ValueError: mismatched shapes, or Hq not a multiple of Hkv.
      TypeError: non-float q/k/v or non-integer lengths.
    """
    B, _, _, N, _ = check_qkv(q, k, v)
    lengths = check_lengths(lengths, B, N)
    logits = grouped_logits(q, k)
    return masked_softmax_attention(logits, valid_mask(lengths, N), v)


