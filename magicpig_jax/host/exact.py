"""Exact decode attention over the host KV cache (XLA FFI, CPU): the layers MagicPIG keeps dense, and dense decoding.

MagicPIG leaves a few layers dense (arXiv 2410.16179, Section 5; the decoder's default is
``{0, num_layers // 2}``). With the KV cache in host memory such a layer reads every cached
key and value once per step, so its cost is the bytes of K and V. The C++ handler
``magicpig_exact_attention`` (``host_ops/exact_attention.cc``) makes one pass over the keys of
each KV head for all ``G = Hq / Hkv`` query heads that share it (flash-decoding order, online
softmax over blocks of 128 keys), reading float32 or bfloat16 K/V in place. It computes the
same function as :func:`magicpig_jax.attention.dense_attention`, up to float32 summation order.

Work items are spans of a KV head's keys (2,048, or down to 256 when the ``B * Hkv`` heads would
give fewer than 8 work items per thread, e.g. one row on two cores), spread over XLA's intra-op
thread pool; the partial softmaxes of a head's spans are merged exactly by the worker that
finishes last. The inner loops have an AVX2/FMA variant chosen at run time and a portable
scalar one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from magicpig_jax.attention._common import check_lengths, check_qkv, check_softcap
from magicpig_jax.host._ext import impl_code, ops
from magicpig_jax.host.validate import check_kv_dtypes, check_pool_threads

__all__ = ["MAX_GROUP", "host_exact_attention"]

MAX_GROUP = 64  # largest G = Hq / Hkv the op accepts (kMaxG of exact_attention.cc)


def host_exact_attention(
    q: Float[Array, "B Hq D"],
    k: Float[Array, "B Hkv N D"],
    v: Float[Array, "B Hkv N D"],
    lengths: Int[Array, " B"] | None = None,
    starts: Int[Array, " B"] | None = None,
    *,
    impl: str = "auto",
    max_threads: int = 0,
    softcap: float | None = None,
) -> tuple[Float[Array, "B Hq D"], Float[Array, "B Hq"]]:
    """Exact softmax attention of one decode step over keys ``starts[b] .. lengths[b] - 1``, in the host op.

    ``o = softmax(q K^T / sqrt(D)) V`` with GQA (query head h reads KV head ``h // G``),
    the same function as :func:`magicpig_jax.attention.dense_attention` (arXiv 2410.16179,
    Eq. (1)); every K and V row is read once for the G query heads of its KV head.

    Args:
      q: float ``[B, Hq, D]`` (computed in float32).
      k, v: ``[B, Hkv, N, D]``, both float32 or both bfloat16 (read in place).
      lengths: int ``[B]`` valid keys per row (default N; clipped to ``[0, N]``).
      starts: int ``[B]`` the first valid key per row (default 0; clipped to ``[0, lengths]``):
        a sliding-window layer's window start. The op reads no key before it.
      impl: ``"auto"`` (AVX2/FMA where the CPU has it), ``"scalar"`` or ``"avx2"``.
      max_threads: cap on the op's worker threads (0: XLA's intra-op pool size).
      softcap: None, or c in [0.001, 1e6]: each logit s becomes ``c * tanh(s / c)`` (Gemma 2's
        ``attn_logit_softcapping``, as :func:`~magicpig_jax.attention._common.softcap_logits`).

    Returns:
      ``(out, lse)``: out float32 ``[B, Hq, D]``; lse float32 ``[B, Hq]``, the natural-log
      log-sum-exp of the logits. A row with no valid key gives ``out = 0`` and
      ``lse = -inf``; a head with a NaN or +inf logit (a non-finite q or k) gives out and lse
      NaN; one whose logits are all -inf (a -inf in q or in every key) gives out NaN and lse
      -inf (its partition function is 0: merged, it weighs 0), never a silently empty row; one
      -inf logit among finite ones weighs 0, as in a softmax.

    Raises:
      ValueError: mismatched shapes, Hq not a multiple of Hkv, ``G > MAX_GROUP``, unknown
        ``impl``, negative ``max_threads``, or a softcap out of [0.001, 1e6].
      TypeError: k and v not both float32 or both bfloat16, or non-integer lengths or starts.
      ImportError: the native extension is not built.

    Source: arXiv 2410.16179, Eq. (1); online softmax of Milakov & Gimelshein (2018).
    """
    code = impl_code(impl)
    softcap = check_softcap(softcap)
    check_pool_threads(max_threads)
    B, Hq, Hkv, N, D = check_qkv(q, k, v)
    check_kv_dtypes(k, v)
    if Hq // Hkv > MAX_GROUP:
        raise ValueError(f"G = Hq / Hkv must be <= {MAX_GROUP}, got {Hq // Hkv}")
    lengths = check_lengths(lengths, B, N)
    starts = jnp.zeros((B,), jnp.int32) if starts is None else check_lengths(starts, B, N, name="starts")
    ops()
    out, lse = jax.ffi.ffi_call(
        "magicpig_exact_attention",
        (jax.ShapeDtypeStruct((B, Hq, D), jnp.float32), jax.ShapeDtypeStruct((B, Hq), jnp.float32)),
        vmap_method="sequential",
    )(q.astype(jnp.float32), k, v, lengths.astype(jnp.int32), starts.astype(jnp.int32), impl=np.int64(code),
      max_threads=np.int64(max_threads), softcap=np.float32(softcap or 0.0))
    return out, lse
