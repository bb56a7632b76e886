"""Exact merge of two partial softmax attentions through their log-sum-exp."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

__all__ = ["merge_attention"]


def merge_attention(
    out_a: Float[Array, "*batch D"],
    lse_a: Float[Array, "*batch"],
    out_b: Float[Array, "*batch D"],
    lse_b: Float[Array, "*batch"],
) -> tuple[Float[Array, "*batch D"], Float[Array, "*batch"]]:
    """Combine two softmax attentions over disjoint key sets into the attention over their union.

    With ``s_x = exp(lse_x)`` the partition functions,
    ``out = (s_a out_a + s_b out_b) / (s_a + s_b)`` and ``lse = log(s_a + s_b)``,
    evaluated with the max-shift so nothing overflows. Natural log throughout
    (the reference CPU kernel's base-2 LSE is a known bug this avoids).
    A part with ``lse = -inf`` contributes nothing beside a part with a finite ``lse``, whatever its
    ``out`` holds. Two such parts give ``lse = -inf`` and ``out = 0`` (empty key sets), or NaN when
    either ``out`` is NaN (keys whose logits are all -inf, as the attention functions return them:
    over the union too the softmax is 0/0). A part with a NaN ``lse`` (a head that read a non-finite
    key), or ``+inf`` (no finite softmax sum has it), gives ``out`` and ``lse`` NaN.

    Args:
      out_a, out_b: float ``[..., D]`` partial outputs (e.g. ``[B, Hq, D]``).
      lse_a, lse_b: float ``[...]`` natural-log LSEs (e.g. ``[B, Hq]``).

    Returns:
      ``(out, lse)`` float32 of the same shapes.

    Raises:
      ValueError: if the shapes disagree (``out`` must have the trailing D axis).
      TypeError: an argument that is not an array (a list, say), or not floating-point (a complex
        ``out`` would lose its imaginary part in the float32 cast).

    Source: the split-softmax identity used by FlashAttention/FlashDecoding;
    MagicPIG merges its host (sampled) part with its accelerator (static) part
    this way (arXiv 2410.16179, Section 4.3).
    """
    for name, a in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"merge_attention: {name} must be an array (jax or NumPy), got {type(a).__name__}")
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"merge_attention: {name} must be floating-point, got {a.dtype}")
    if out_a.ndim < 1 or out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            "merge_attention needs out_a/out_b of shape [..., D] and lse_a/lse_b of shape [...]; got "
            f"{tuple(out_a.shape)}, {tuple(lse_a.shape)}, {tuple(out_b.shape)}, {tuple(lse_b.shape)}"
        )
    lse_a = lse_a.astype(jnp.float32)
    lse_b = lse_b.astype(jnp.float32)
    m = jnp.maximum(lse_a, lse_b)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    wa = jnp.where(lse_a == -jnp.inf, 0.0, jnp.exp(lse_a - m_safe))
    wb = jnp.where(lse_b == -jnp.inf, 0.0, jnp.exp(lse_b - m_safe))
    total = wa + wb
    denom = jnp.where(total > 0, total, 1.0)
    # An empty part's out is never read (0 * NaN would be NaN): it may hold anything.
    out = (jnp.where((lse_a == -jnp.inf)[..., None], 0.0, wa[..., None] * out_a.astype(jnp.float32))
           + jnp.where((lse_b == -jnp.inf)[..., None], 0.0, wb[..., None] * out_b.astype(jnp.float32)))
    out = out / denom[..., None]
    lse = jnp.where(total > 0, m_safe + jnp.log(denom), -jnp.inf)
    # both parts at -inf: keys whose logits are all -inf in either (out NaN) leave the union's softmax 0/0
    minus_inf_keys = (jnp.any(jnp.isnan(out_a), axis=-1) & (lse_a == -jnp.inf)) | (
        jnp.any(jnp.isnan(out_b), axis=-1) & (lse_b == -jnp.inf))
    out = jnp.where(((total == 0) & minus_inf_keys)[..., None], jnp.nan, out)
    # A NaN part (a non-finite key upstream) stays NaN: never read as an empty part.
    broken = jnp.isnan(lse_a) | jnp.isnan(lse_b) | (lse_a == jnp.inf) | (lse_b == jnp.inf)  # +inf: no finite sum
    return jnp.where(broken[..., None], jnp.nan, out), jnp.where(broken, jnp.nan, lse)
