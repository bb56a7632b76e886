"""Exact TopK attention on the host KV cache (XLA FFI, CPU): the TopK baseline at its best host implementation.

TopK (arXiv 2410.16179, Section 3.1) must score every key of the range to find its top set,
so it reads all of K of the range once per step, plus the V rows it keeps. The C++ handler
``magicpig_topk_attention`` (``host_ops/topk_attention.cc``) reads each K row once for the
``G = Hq / Hkv`` query heads of its KV head, keeps each head's ``keep`` highest logits with a
partial selection (a radix select on the logits' rank bits: descending logit, ties by the smaller
position; linear, not a sort) and attends exactly over them, gathering their V rows. Work items
on XLA's intra-op pool are (row, KV head), or, with fewer than 8 KV heads per thread (one row
on two cores), spans of a KV head's keys scored over all threads and then one selection per
query head; the dot products and the V accumulation have an AVX2/FMA variant.

:func:`host_topk_attention` has the semantics of :func:`magicpig_jax.attention.topk_attention`
over a range ``[start, end)`` of the cache (the decoder's hashed range), so the
``"topk"`` backend can run either (:mod:`magicpig_jax.models.backends`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from magicpig_jax.attention._common import check_lengths, check_qkv, check_softcap
from magicpig_jax.attention.baselines import Budget, budget_tokens, check_budget
from magicpig_jax.host._ext import impl_code, ops
from magicpig_jax.host.exact import MAX_GROUP
from magicpig_jax.host.validate import check_int, check_kv_dtypes

__all__ = ["host_topk_attention", "range_bounds"]


def range_bounds(B: int, N: int, lengths, start) -> tuple[jax.Array, jax.Array]:
    """``(start, end)`` int32 ``[B]`` of a range: ``[start, lengths)`` clipped to ``[0, N]`` (start default 0).

    Raises:
      ValueError / TypeError: ``lengths`` or ``start`` not int ``[B]``.
    """
    end = check_lengths(lengths, B, N)
    if start is None:
        return jnp.zeros((B,), jnp.int32), end
    s = check_lengths(start, B, N, "start")
    return s, jnp.maximum(end, s)


def host_topk_attention(
    q: Float[Array, "B Hq D"],
    k: Float[Array, "B Hkv N D"],
    v: Float[Array, "B Hkv N D"],
    budget: Budget,
    lengths: Int[Array, " B"] | None = None,
    *,
    start: Int[Array, " B"] | None = None,
    context: Int[Array, " B"] | None = None,
    impl: str = "auto",
    max_threads: int = 0,
    softcap: float | None = None,
) -> tuple[Float[Array, "B Hq D"], Float[Array, "B Hq"]]:
    """Exact TopK attention over the keys ``[start, lengths)`` of each row, in the host op.

    Each query head keeps the ``min(budget_tokens(budget, n_b), n_b)`` keys of the range with the
    largest ``q·k/sqrt(D)`` (``n_b = lengths[b] - start[b]``; ties broken by position) and
    attends exactly over them. With ``start=None`` this is
    :func:`magicpig_jax.attention.topk_attention` ``(q, k, v, budget, lengths)``; with ``start``
    it is ``topk_attention`` on the keys from ``start`` (for the decoder, whose sinks are static).
    With ``context``, the keys ``[0, start)`` and ``[lengths, context)`` (a decoder's sinks and
    unhashed tail) are attended exactly too, in the same softmax: the result is TopK of the range
    merged with the static set (:func:`magicpig_jax.attention.merge_attention`), in one pass.

    Args:
      q: float ``[B, Hq, D]`` (computed in float32).
      k, v: ``[B, Hkv, N, D]``, both float32 or both bfloat16 (read in place).
      budget: ``int >= 1`` tokens or a ``float`` in ``(0, 1]`` fraction of each row's range
        (see :func:`magicpig_jax.attention.budget_tokens`).
      lengths: int ``[B]``, the end of each row's range (default N; clipped to ``[0, N]``).
      start: int ``[B]``, the start of each row's range (default 0; clipped to ``[0, N]``).
      context: optional int ``[B]``, each row's valid keys (clipped to ``[lengths, N]``): also attend
        ``[0, start)`` and ``[lengths, context)`` exactly.
      impl: ``"auto"`` (AVX2/FMA where the CPU has it), ``"scalar"`` or ``"avx2"``.
      max_threads: cap on the op's worker threads (0: XLA's intra-op pool).
      softcap: None, or c in [0.001, 1e6]: each logit s of the softmax becomes ``c * tanh(s / c)``
        (Gemma 2's ``attn_logit_softcapping``); the selection ranks the uncapped logits, which the
        monotone cap orders the same way.

    Returns:
      ``(out, lse)``: out float32 ``[B, Hq, D]``, lse float32 ``[B, Hq]`` (natural log of the kept
      logits' sum of exponentials); an empty range gives ``0, -inf``.

    Raises:
      ValueError: mismatched shapes, Hq not a multiple of Hkv, ``G > MAX_GROUP``, a budget out of
        range, unknown ``impl``, a bad ``max_threads`` or a softcap out of range.
      TypeError: k and v not both float32 or both bfloat16, a budget of the wrong type.
      ImportError: the native extension is not built.

    Source: arXiv 2410.16179, Section 3.1 (the TopK baseline).
    """
    code = impl_code(impl)
    max_threads = check_int("max_threads", max_threads, 0, 4096)
    B, Hq, Hkv, N, D = check_qkv(q, k, v)
    check_kv_dtypes(k, v)
    check_budget(budget)
    softcap = check_softcap(softcap)
    if Hq // Hkv > MAX_GROUP:
        raise ValueError(f"G = Hq / Hkv must be <= {MAX_GROUP}, got {Hq // Hkv}")
    s, e = range_bounds(B, N, lengths, start)
    n = e - s
    keep = jnp.minimum(budget_tokens(budget, n), n).astype(jnp.int32)
    ctx = jnp.zeros_like(e) if context is None else check_lengths(context, B, N, "context")
    ops()
    return jax.ffi.ffi_call(
        "magicpig_topk_attention",
        (jax.ShapeDtypeStruct((B, Hq, D), jnp.float32), jax.ShapeDtypeStruct((B, Hq), jnp.float32)),
        vmap_method="sequential",
    )(q.astype(jnp.float32), k, v, s, e, keep, ctx, with_static=np.int64(context is not None), impl=np.int64(code),
      max_threads=np.int64(max_threads), softcap=np.float32(softcap or 0.0))
