"""Building the host index after prefill and appending keys to it (XLA FFI, CPU).

The mean of the hashed keys is computed in JAX exactly as
:func:`magicpig_jax.attention.build_lsh_index` does (arXiv 2410.16179, Section 4.2); the SimHash
codes of the centered keys come from the host kernel (:func:`~magicpig_jax.host.simhash.host_simhash_codes`,
which centers each row in a small buffer, so no float32 copy of the keys and no ``[.., K*L]``
projection temporary is made); the C++ handlers ``magicpig_host_build`` and
``magicpig_host_append`` (``host_ops/magicpig_host.cc``) sort them into the chunked tables of
:class:`~magicpig_jax.host.index.HostIndex`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt32

from magicpig_jax.attention._common import widened
from magicpig_jax.attention.config import MagicPIGConfig
from magicpig_jax.attention.magicpig import hashed_mean, mean_or_nan_for_projections
from magicpig_jax.host._ext import ops
from magicpig_jax.host.index import DEFAULT_OPEN_CAPACITY, MAX_CHUNK, HostIndex, chunk_geometry
from magicpig_jax.host.simhash import host_simhash_codes
from magicpig_jax.host.validate import check_config, check_int, check_lengths_strict

__all__ = ["host_build_index", "host_append", "host_key_codes", "first_mean"]


def host_build_index(
    k: Float[Array, "B Hkv N D"],
    projections: Float[Array, "D KL"],
    config: MagicPIGConfig,
    lengths: Int[Array, " B"] | None = None,
    capacity: int | None = None,
    open_capacity: int = DEFAULT_OPEN_CAPACITY,
    max_threads: int = 0,
    chunk_size: int | None = None,
) -> HostIndex:
    """Build the host index of one layer after prefill (mirrors :func:`build_lsh_index`).

    The mean of the hashed range (:meth:`MagicPIGConfig.hashed_range`) is
    :func:`build_lsh_index`'s (:func:`hashed_mean`); the SimHash codes of the centered keys
    come from :func:`~magicpig_jax.host.simhash.host_simhash_codes`; the FFI op sorts them into
    the chunked tables.

    Args:
      k: float ``[B, Hkv, N, D]`` keys.
      projections: float32 ``[D, K*L]``.
      config: :class:`MagicPIGConfig` with ``1 <= K <= 16`` and ``2 <= L <= 4096``.
      lengths: int ``[B]`` valid keys per row (default N); concrete values outside
        ``[0, N]`` raise.
      capacity: positions the index must hold, including later appends
        (default N; must be in ``[N, 2^31 - 1]``).
      open_capacity: size of the open chunk, ``[1, 65535]`` (default 512).
      max_threads: cap on worker threads (0 = XLA's intra-op pool size).
      chunk_size: positions per chunk, ``[1, 65535]`` (default: balanced chunks of
        at most 65535).

    Returns:
      A :class:`HostIndex`.

    Raises:
      TypeError / ValueError: naming the bad parameter and the allowed values (integer projections, or
        concrete ones with a NaN or infinity; traced ones make the mean NaN:
        :func:`~magicpig_jax.attention.magicpig.mean_or_nan_for_projections`).
      ImportError: the native extension is not built.

    Source: arXiv 2410.16179, Sections 4.2-4.3.
    """
    check_config(config)
    if not hasattr(k, "ndim") or k.ndim != 4:
        raise ValueError(f"k must be [B, Hkv, N, D], got shape {tuple(getattr(k, 'shape', ()))}")
    if not jnp.issubdtype(k.dtype, jnp.floating):
        raise TypeError(f"k must be a floating dtype (float32 or bfloat16), got {k.dtype}")
    B, Hkv, N, D = k.shape
    capacity = N if capacity is None else check_int("capacity", capacity, N, 2**31 - 1)
    open_capacity = check_int("open_capacity", open_capacity, 1, MAX_CHUNK)
    max_threads = check_int("max_threads", max_threads, 0, 4096)
    if chunk_size is not None:
        chunk_size = check_int("chunk_size", chunk_size, 1, MAX_CHUNK)
    lengths = check_lengths_strict(lengths, B, N)
    if not hasattr(projections, "shape"):
        raise TypeError(f"projections must be an array [D, K*L] (jax or NumPy), got {type(projections).__name__}")
    if tuple(projections.shape) != (D, config.K * config.L):
        raise ValueError(f"projections must be [D, K*L] = [{D}, {config.K * config.L}] for K={config.K}, "
                         f"L={config.L}, got {tuple(projections.shape)}")
    start, end, mean = hashed_mean(k, config, lengths)
    mean = mean_or_nan_for_projections(mean, jnp.asarray(projections))  # refuses integer or non-finite ones
    # a copy: the index is donated to host_append, which must not delete the caller's hyperplanes
    projections = jnp.array(projections, jnp.float32, copy=True)
    codes = host_simhash_codes(k, projections, config.K, config.L, center=mean, max_threads=max_threads)
    ops()
    nc, ch = chunk_geometry(capacity, chunk_size)
    nbk = (1 << config.K) + 1
    out_types = (
        jax.ShapeDtypeStruct((B, Hkv, nc, config.L, ch), jnp.uint16),
        jax.ShapeDtypeStruct((B, Hkv, nc, config.L, nbk), jnp.uint16),
        jax.ShapeDtypeStruct((B, Hkv, config.L, open_capacity), jnp.uint16),
        jax.ShapeDtypeStruct((B, 3), jnp.int32),
    )
    ids, offsets, open_codes, bounds = jax.ffi.ffi_call(
        "magicpig_host_build", out_types, vmap_method="sequential"
    )(codes, start.astype(jnp.int32), end.astype(jnp.int32),
      K=np.int64(config.K), max_threads=np.int64(max_threads))
    return HostIndex(ids=ids, offsets=offsets, open_codes=open_codes, bounds=bounds, mean=mean,
                     projections=projections, K=config.K, L=config.L, num_sink=config.num_sink,
                     num_local=config.num_local)


def first_mean(index: HostIndex, k_new: Float[Array, "B Hkv T D"], counts: Int[Array, " B"]) -> HostIndex:
    """The index with a mean for each row whose hashed range is still empty: its first appended keys'.

    After a prefill no longer than ``num_sink + num_local`` the hashed range ``[start, end)`` is
    empty and the mean is 0. The first append of ``counts[b] > 0`` keys into such a row sets the
    row's mean (per KV head) to the mean of those keys, so they, and every later key, are hashed
    centered (arXiv 2410.16179, Section 4.2); the mean of a row that already hashes keys is kept.
    The keys past ``counts[b]`` are selected out (their rows may hold anything).

    Args:
      index: the layer's :class:`HostIndex`.
      k_new: float ``[B, Hkv, T, D]``, the ``T`` keys being appended (``T`` new positions).
      counts: int32 ``[B]`` in ``[0, T]``, the keys each row appends.

    Returns:
      ``index`` with ``mean`` (float32 ``[B, Hkv, D]``) set for the rows that were empty.
    """
    T = k_new.shape[2]
    empty = (index.end == index.start) & (counts > 0)  # [B]
    use = jnp.arange(T, dtype=jnp.int32)[None, :] < counts[:, None]  # [B, T]
    total = jnp.sum(jnp.where(use[:, None, :, None], jnp.asarray(k_new).astype(jnp.float32), 0.0), axis=2)
    first = total / jnp.maximum(counts, 1).astype(jnp.float32)[:, None, None]
    first = mean_or_nan_for_projections(first, index.projections)  # a NaN hyperplane keeps the mean NaN
    return dataclasses.replace(index, mean=jnp.where(empty[:, None, None], first, index.mean))


def host_key_codes(index: HostIndex, k_new: Float[Array, "B Hkv T D"]) -> UInt32[Array, "B Hkv T L"]:
    """SimHash codes of new keys, centered by the index's mean (what :func:`host_append` inserts).

    Args:
      index: the layer's :class:`HostIndex`.
      k_new: float ``[B, Hkv, T, D]`` keys.

    Returns:
      uint32 ``[B, Hkv, T, L]``: :func:`magicpig_jax.lsh.simhash_codes` of
      ``k_new - index.mean``, by the host kernel (:func:`~magicpig_jax.host.simhash.host_simhash_codes`).

    Raises:
      TypeError, ValueError, ImportError: as :func:`~magicpig_jax.host.simhash.host_simhash_codes`.
    """
    return host_simhash_codes(k_new, index.projections, index.K, index.L, center=index.mean)


def _check_counts(counts, B: int, T: int) -> jax.Array:
    """int32 ``[B]`` counts in ``[0, T]`` (default T); concrete values outside raise ``ValueError``."""
    if counts is None:
        return jnp.full((B,), T, jnp.int32)
    if not isinstance(counts, jax.core.Tracer):
        c = np.asarray(counts)
        if c.shape != (B,) or not np.issubdtype(c.dtype, np.integer):
            raise ValueError(f"counts must be int [B] = [{B}], got {c.dtype} {list(c.shape)}")
        if c.size and (c.min() < 0 or c.max() > T):
            raise ValueError(f"counts must be in [0, T={T}], got {c.tolist()}")
    counts = jnp.asarray(counts)
    if counts.shape != (B,) or not jnp.issubdtype(counts.dtype, jnp.integer):
        raise ValueError(f"counts must be int [B] = [{B}], got {counts.dtype} {list(counts.shape)}")
    counts = widened(counts)
    info = jnp.iinfo(counts.dtype)
    if info.max > np.iinfo(np.int32).max or info.min < np.iinfo(np.int32).min:
        # traced int64/uint32 counts past int32 wrapped into range (2**32 + 1 appended 1 key): bounded in
        # their own width to [-1, T + 1], so the op still refuses them
        counts = jnp.clip(counts, max(int(info.min), -1), T + 1)
    return counts.astype(jnp.int32)


def host_append(
    index: HostIndex,
    k_new: Float[Array, "B Hkv T D"],
    counts: Int[Array, " B"] | None = None,
    max_threads: int = 0,
) -> HostIndex:
    """Insert keys into the index at positions ``end[b], end[b] + 1, ...`` of each row.

    Row b appends its first ``counts[b]`` new keys (default T); the hashed range
    becomes ``[start, end + counts)``, so these keys move from the static set to the
    sampled set (e.g. decode tokens leaving a generation buffer). They are centered
    with the index's mean (arXiv 2410.16179, Section 4.2); a row whose hashed range is still
    empty (a prompt no longer than ``num_sink + num_local``) first takes the mean of the keys
    it appends (:func:`first_mean`), so generated tokens are never hashed uncentered. The buffers are aliased
    input -> output, so under ``jax.jit`` with the index donated the append is in
    place: O(L) per key, plus a merge of the open chunk into the sorted chunks each
    time it fills. The capacity is static; appending past it fails at run time.

    Args:
      index: the :class:`HostIndex` (donate it under jit).
      k_new: float ``[B, Hkv, T, D]`` the new keys (uncentered).
      counts: int ``[B]`` in ``[0, T]`` (default T).
      max_threads: cap on worker threads (0 = XLA's pool size).

    Returns:
      The updated :class:`HostIndex` (its ``mean`` changed only for rows that were empty).

    Raises:
      TypeError / ValueError: bad shapes, dtypes or counts (run-time errors from the
      op for capacity overflow).
      ImportError: the native extension is not built.
    """
    if not isinstance(index, HostIndex):
        raise TypeError(f"index must be a HostIndex, got {type(index).__name__}")
    if not hasattr(k_new, "ndim") or k_new.ndim != 4:
        raise ValueError(f"k_new must be [B, Hkv, T, D], got shape {tuple(getattr(k_new, 'shape', ()))}")
    if not jnp.issubdtype(k_new.dtype, jnp.floating):
        raise TypeError(f"k_new must be a floating dtype, got {k_new.dtype}")
    B, Hkv, T, D = k_new.shape
    if index.mean.shape != (B, Hkv, D):
        raise ValueError(
            f"k_new {tuple(k_new.shape)} does not match the index (mean {tuple(index.mean.shape)})"
        )
    max_threads = check_int("max_threads", max_threads, 0, 4096)
    counts = _check_counts(counts, B, T)
    ops()
    index = first_mean(index, k_new, counts)
    codes = host_key_codes(index, k_new)
    out_types = (
        jax.ShapeDtypeStruct(index.ids.shape, jnp.uint16),
        jax.ShapeDtypeStruct(index.offsets.shape, jnp.uint16),
        jax.ShapeDtypeStruct(index.open_codes.shape, jnp.uint16),
        jax.ShapeDtypeStruct(index.bounds.shape, jnp.int32),
    )
    ids, offsets, open_codes, bounds = jax.ffi.ffi_call(
        "magicpig_host_append",
        out_types,
        vmap_method="sequential",
        input_output_aliases={0: 0, 1: 1, 2: 2, 3: 3},
    )(index.ids, index.offsets, index.open_codes, index.bounds, codes, counts,
      K=np.int64(index.K), max_threads=np.int64(max_threads))
    return dataclasses.replace(index, ids=ids, offsets=offsets, open_codes=open_codes, bounds=bounds)
