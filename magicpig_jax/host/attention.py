"""Sampled attention on the host index (XLA FFI, CPU), and one MagicPIG decode step built on it.

Lookup (per query head, ``host_ops/magicpig_host.cc``): for every chunk, walk the query's
bucket of each table once, counting hits in two per-thread bitsets over the chunk's
positions (first and second hit, cleared per chunk visit; an id is emitted at its second
hit), so no per-step work is proportional to N besides the walk itself; the open chunk is
compared code by code. The candidates are attended in one pass, in blocks of 32 (an online
softmax), and their K/V rows are prefetched (:func:`~magicpig_jax.host.advise_huge_pages` backs the buffers
with huge pages). ``log u`` comes from the table of :mod:`magicpig_jax.host.log_u`. Work is
split over (row, query head) with XLA's intra-op thread pool; when those are fewer than the
pool's threads (``B * Hq`` below them, e.g. one row of one head on two cores), each head's
positions are split into ``threads / gcd(B * Hq, threads)`` pieces of at least 1,024 (a piece walks only its
ids of each bucket, which are stored in ascending order, so the sampled set is the same) and
the pieces' ``(out, lse)`` are merged exactly. The inner loops have an AVX2/FMA variant
chosen at run time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt32

from magicpig_jax.attention._common import check_qkv, check_softcap
from magicpig_jax.attention.config import MagicPIGConfig
from magicpig_jax.attention.merge import merge_attention
from magicpig_jax.attention.static import static_attention
from magicpig_jax.host._ext import impl_code, ops
from magicpig_jax.host.index import HostIndex
from magicpig_jax.host.log_u import table_operand
from magicpig_jax.host.simhash import host_simhash_codes
from magicpig_jax.host.validate import (
    check_config,
    check_index,
    check_index_buffers,
    check_int,
    check_kv_dtypes,
    check_lengths_strict,
)

__all__ = ["host_sampled_attention", "host_magicpig_attention"]


def host_sampled_attention(
    q: Float[Array, "B Hq D"],
    q_codes: UInt32[Array, "B Hq L"],
    k: Float[Array, "B Hkv N D"],
    v: Float[Array, "B Hkv N D"],
    index: HostIndex,
    lengths: Int[Array, " B"],
    *,
    window: int = 0,
    sinks: bool = False,
    impl: str = "auto",
    return_mask: bool = False,
    max_threads: int = 0,
    softcap: float | None = None,
):
    """The FFI op alone: attention over the LSH-sampled keys (and unhashed keys before the window).

    For query head h (KV head ``h // (Hq // Hkv)``), the keys of ``[start, end)``
    (and ``< lengths``) whose code equals the query's in >= 2 tables get the logit
    ``q·k/sqrt(D) - log u`` (arXiv 2410.16179, Eq. (4), (9)); the unhashed keys of
    ``[end, lengths - window)`` get the exact logit ``q·k/sqrt(D)`` (not counted as
    sampled), and so do the sinks ``[0, start)`` when ``sinks``.

    Args:
      q: float ``[B, Hq, D]``; q_codes: uint32 ``[B, Hq, L]``, the query's SimHash codes.
      k, v: ``[B, Hkv, N, D]``, both float32 or both bfloat16 (read in place).
      index: the layer's :class:`HostIndex`; lengths: int ``[B]`` valid keys per row (concrete values
        outside ``[0, N]`` raise; traced ones are clipped into it).
      window: ``>= 0``, the tail positions left to the caller.
      sinks: attend the sinks ``[0, start)`` too (else they are left to the caller).
      impl: ``"auto"``, ``"scalar"`` or ``"avx2"``; max_threads: ``[0, 4096]`` (0 = XLA's pool).
      return_mask: also return the sampled keys.
      softcap: None, or c in [0.001, 1e6]: every logit ``q·k/sqrt(D)`` is soft-capped to ``c * tanh(. / c)``
        before ``log u`` is subtracted (Gemma 2).

    Returns:
      ``(out f32 [B, Hq, D], lse f32 [B, Hq] natural log, num_sampled int32 [B, Hq])``
      (+ ``mask`` bool ``[B, Hq, N]`` of the sampled keys if ``return_mask``); an empty set
      gives out 0, lse -inf.

    Raises:
      TypeError / ValueError: bad ``impl``, ``window``, ``max_threads``, ``softcap``, shapes or dtypes,
        an ``index`` that is not a :class:`HostIndex` or whose buffers do not fit the cache (named).
      ImportError: the native extension is not built.
    """
    code = impl_code(impl)
    softcap = check_softcap(softcap)
    window = check_int("window", window, 0, 2**31 - 1)
    max_threads = check_int("max_threads", max_threads, 0, 4096)
    B, Hq, Hkv, N, D = check_qkv(q, k, v)
    check_kv_dtypes(k, v)
    lengths = check_lengths_strict(lengths, B, N)  # int [B] in [0, N]; None: N
    check_index_buffers(index, B, Hkv, D)
    if q_codes.shape != (B, Hq, index.L) or q_codes.dtype != jnp.uint32:
        raise ValueError(f"q_codes must be uint32 [B, Hq, L] = {[B, Hq, index.L]}, "
                         f"got {q_codes.dtype} {list(q_codes.shape)}")
    ops()
    table = table_operand(index.K, index.L)
    out_types = (
        jax.ShapeDtypeStruct((B, Hq, D), jnp.float32),
        jax.ShapeDtypeStruct((B, Hq), jnp.float32),
        jax.ShapeDtypeStruct((B, Hq), jnp.int32),
        jax.ShapeDtypeStruct((B, Hq, N) if return_mask else (0,), jnp.uint8),
    )
    out, lse, ns, mask = jax.ffi.ffi_call("magicpig_host_attention", out_types, vmap_method="sequential")(
        q.astype(jnp.float32), q_codes, k, v, index.ids, index.offsets, index.open_codes, index.bounds,
        index.mean, lengths.astype(jnp.int32), table,
        K=np.int64(index.K), window=np.int64(window), sinks=np.int64(bool(sinks)), impl=np.int64(code),
        max_threads=np.int64(max_threads), softcap=np.float32(softcap or 0.0),
    )
    if return_mask:
        return out, lse, ns, mask.astype(bool)
    return out, lse, ns


def host_magicpig_attention(
    q: Float[Array, "B Hq D"],
    k: Float[Array, "B Hkv N D"],
    v: Float[Array, "B Hkv N D"],
    host_index: HostIndex,
    config: MagicPIGConfig,
    lengths: Int[Array, " B"] | None = None,
    *,
    static_window: int | None = None,
    impl: str = "auto",
    return_mask: bool = False,
    max_threads: int = 0,
    softcap: float | None = None,
):
    """One decode step of MagicPIG attention with the sampled part on the host (drop-in for
    :func:`magicpig_jax.attention.magicpig_attention`).

    Same semantics as the pure-JAX reference: keys of the hashed range ``[start, end)``
    colliding with the query in >= 2 of L tables enter with logit ``q·k/sqrt(D) - log u``;
    every other valid key (sinks, local window, keys past the index) is exact. The
    sampled part runs in the FFI op; the static part is
    :func:`~magicpig_jax.attention.static.static_attention` in JAX over the sinks
    ``[0, start)`` and the last ``static_window`` positions
    ``[max(end, lengths - static_window), lengths)`` (slices, so its cost does not
    grow with N); unhashed keys between ``end`` and that window are handled exactly by
    the op. The parts are merged with :func:`merge_attention` (natural-log LSE).

    Args:
      q: float ``[B, Hq, D]``.
      k, v: ``[B, Hkv, N, D]`` float32 or bfloat16 (same dtype).
      host_index: :class:`HostIndex` of this layer (same B, Hkv, D).
      config: the :class:`MagicPIGConfig` the index was built with.
      lengths: int ``[B]`` valid keys per row (default N); concrete values outside
        ``[0, N]`` raise, traced values are clipped.
      static_window: tail positions handled by JAX, ``>= 0`` (0: the op attends the sinks and
        the whole tail itself, nothing is left to JAX; default
        :meth:`MagicPIGConfig.static_window`: the local window plus two generation buffers,
        the longest unhashed tail of the decoder).
      impl: ``"auto"`` (AVX2 if the CPU has it), ``"scalar"`` or ``"avx2"``.
      return_mask: also return the bool ``[B, Hq, N]`` mask of the sampled keys.
      max_threads: cap on the op's worker threads (0 = XLA's intra-op pool size).
      softcap: None, or c in [0.001, 1e6]: Gemma 2's logit soft-capping ``c * tanh(s / c)`` of every score,
        in the op and in the static part alike.

    Returns:
      ``(out, lse, num_sampled)`` (+ ``mask``): out float32 ``[B, Hq, D]``, lse float32
      ``[B, Hq]``, num_sampled int32 ``[B, Hq]``.

    Raises:
      TypeError / ValueError: naming the bad parameter and the allowed values.
      ImportError: the native extension is not built.

    Source: arXiv 2410.16179, Eq. (4) and (9), Sections 4.2-4.3.
    """
    check_config(config)
    softcap = check_softcap(softcap)
    B, Hq, Hkv, N, D = check_qkv(q, k, v)
    check_kv_dtypes(k, v)
    check_index(host_index, config, B, Hkv, D)
    if static_window is None:
        static_window = config.static_window()
    static_window = check_int("static_window", static_window, 0, 2**31 - 1)
    lengths = check_lengths_strict(lengths, B, N)
    q_codes = host_simhash_codes(q, host_index.projections, config.K, config.L, max_threads=max_threads)
    if static_window == 0:
        # Nothing is left to JAX: the op attends the sinks and the whole unhashed tail itself (one
        # softmax, no static part and no merge in the step: fewer XLA ops per layer).
        return host_sampled_attention(q, q_codes, k, v, host_index, lengths, window=0, sinks=True, impl=impl,
                                      return_mask=return_mask, max_threads=max_threads, softcap=softcap)
    res = host_sampled_attention(q, q_codes, k, v, host_index, lengths, window=static_window, impl=impl,
                                 return_mask=return_mask, max_threads=max_threads, softcap=softcap)
    # The static set: sinks [0, start) (start <= num_sink by construction) and the last
    # static_window positions of the tail, read as slices so the cost does not grow with N.
    start = jnp.minimum(host_index.start, lengths)
    o_s, l_s = static_attention(q, k, v, start, host_index.end, lengths, num_sink=config.num_sink,
                                window=static_window, softcap=softcap)
    out, lse = merge_attention(res[0], res[1], o_s, l_s)
    if return_mask:
        return out, lse, res[2], res[3]
    return out, lse, res[2]
