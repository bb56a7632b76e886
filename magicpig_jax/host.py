"""MagicPIG on host memory: the LSH index and sampled attention as XLA FFI custom calls (CPU).

The C++ handlers (``host_ops/magicpig_host.cc``, built by ``pip install`` through
scikit-build-core + CMake into ``magicpig_jax._host_ops``) are registered with
``jax.ffi.register_ffi_target(..., platform="cpu")`` when this module is imported.
Everything they read and write is an XLA buffer: the index is the
pytree :class:`HostIndex` returned by :func:`host_build_index` and passed back in,
so it lives in host memory as JAX arrays, works inside ``jax.jit``, and the
handlers keep no state between calls (they are safe to run from several threads).

Index layout per (row b, KV head h), capacity ``C = NC * CH`` positions cut into
``NC`` chunks of ``CH <= 65536`` consecutive positions (chunk c covers
``[c*CH, (c+1)*CH)``):

* ``ids`` uint16 ``[B, Hkv, NC, L, CH]``: per chunk and table, the chunk-relative
  token ids sorted by bucket (arXiv 2410.16179, Section 4.3; notes section 8);
* ``offsets`` int32 ``[B, Hkv, NC, L, 2^K + 1]``: bucket starts (end = next start;
  the last entry is the number of tokens in the chunk);
* ``open_codes`` uint16 ``[B, Hkv, L, OPEN]``: codes of the open chunk, the most
  recently appended ``<= OPEN`` keys, scanned linearly by code comparison; when it is
  full, the next append merges it into the sorted chunks (amortized O(L) per key);
* ``bounds`` int32 ``[B, 3]``: ``(start, end, sealed_end)``; the hashed range is
  ``[start, end)``, ``[start, sealed_end)`` sits in the sorted chunks and
  ``[sealed_end, end)`` in the open chunk.

Bytes per token per KV head: ``2 L`` (ids) + ``4 L (2^K + 1) / CH`` (offsets)
+ ``2 L OPEN / C``; at K=10, L=150, C=128K: 300 + 9.4 + 0.6 = 310 B, i.e. 0.61x the
512 B of bf16 K+V at D=128 (the reference's int32 layout: 600 B, 1.17x).

Lookup (per query head): for every chunk, walk the query's bucket of each table once
over a per-thread array of 16-bit stamps ``(epoch << 2) | hits`` (a new epoch per
chunk visit makes stale stamps read as zero hits; an id is emitted when its hits reach
2), so nothing is cleared per step and no per-step work is proportional to N besides
the walk itself; the open chunk is compared code by code. The K/V rows of the
candidates are prefetched; :func:`advise_huge_pages` backs the buffers with huge pages.
``log u`` is tabulated: ``log u = 2K log p + f(p)`` with ``f = log(u / p^(2K))``,
a smooth function of ``p`` on ``[0, 1]`` tabulated in float64 on 2^14 + 1 points
(:func:`log_u_table`) and interpolated linearly (on AVX2, 8 candidates at a time with
polynomial arccos and log); its accuracy against the exact form is tested. Work is
split over (row, query head) with XLA's intra-op thread pool; the inner loops have an
AVX2/FMA variant chosen at run time.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import math
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt16, UInt32

from magicpig_jax import lsh
from magicpig_jax.attention._common import check_lengths, check_qkv, grouped_logits, masked_softmax_attention
from magicpig_jax.attention.config import MagicPIGConfig
from magicpig_jax.attention.dense import dense_attention
from magicpig_jax.attention.magicpig import LOG_U_FLOOR, LSHIndex, build_lsh_index
from magicpig_jax.attention.merge import merge_attention

__all__ = [
    "HostIndex",
    "host_build_index",
    "host_append",
    "host_key_codes",
    "host_sampled_attention",
    "host_magicpig_attention",
    "host_log_u",
    "log_u_table",
    "index_nbytes",
    "chunk_geometry",
    "has_avx2",
    "advise_huge_pages",
    "HOST_MAX_K",
    "HOST_MAX_L",
    "DEFAULT_OPEN_CAPACITY",
    "DEFAULT_GENERATION_BUFFER",
]

HOST_MAX_K = 16  # bucket offsets are 2^K + 1 int32 per chunk and table
HOST_MAX_L = 4096
MAX_CHUNK = 65536  # uint16 token ids
DEFAULT_OPEN_CAPACITY = 512
DEFAULT_GENERATION_BUFFER = 256
LOG_U_TABLE_SIZE = 1 << 14
_IMPLS = {"auto": 0, "scalar": 1, "avx2": 2}

# ---------------------------------------------------------------------------------------------
# Loading and registering the handlers (lazily, once).
# ---------------------------------------------------------------------------------------------

_lock = threading.Lock()
_module = None


def _ops():
    """Import the extension (or ``$MAGICPIG_HOST_OPS_LIB``) and register its FFI targets once."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        path = os.environ.get("MAGICPIG_HOST_OPS_LIB")
        if path:
            spec = importlib.util.spec_from_file_location("magicpig_jax._host_ops", path)
            if spec is None or spec.loader is None:
                raise ImportError(f"MAGICPIG_HOST_OPS_LIB={path!r} is not a loadable extension module")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        else:
            try:
                mod = importlib.import_module("magicpig_jax._host_ops")
            except ImportError as e:  # pragma: no cover - depends on the install
                raise ImportError(
                    "magicpig_jax._host_ops is not built; reinstall the package with "
                    "`pip install -e .` (scikit-build-core + CMake compile host_ops/)"
                ) from e
        for name, capsule in mod.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        _module = mod
    return _module


def advise_huge_pages(*trees) -> int:
    """Ask Linux to back the CPU buffers of ``trees`` with 2 MiB transparent huge pages.

    The sampled-attention op reads K/V rows and bucket lists at random places in arrays of
    hundreds of MB; with 4 KiB pages nearly every row misses the TLB. This applies
    ``madvise(MADV_HUGEPAGE)`` and ``madvise(MADV_COLLAPSE)`` (Linux >= 6.1) to the 2 MiB
    aligned interior of each CPU buffer. Values are unchanged; call it once on buffers that
    stay in place (the decoder does, for the cache and host indices it donates every step).
    At 128K tokens on the Llama-3.1-8B layer shape it cut the op from about 7.3 to 5.8 ms
    (``magicpig-jax bench attention``).

    Args:
      trees: arrays or pytrees of arrays (e.g. a :class:`HostIndex`, a KV cache).

    Returns:
      Bytes now backed by huge pages (0 where the kernel or platform does not support it,
      e.g. non-Linux, THP disabled, or non-CPU arrays). Never raises for those cases.
    """
    mod = _ops()
    total = 0
    for leaf in jax.tree.leaves(trees):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            data = shard.data
            if data.devices().pop().platform != "cpu" or data.nbytes < (2 << 20):
                continue
            try:
                ptr = data.unsafe_buffer_pointer()
            except Exception:  # noqa: BLE001 - e.g. deleted or non-contiguous buffers: skip them
                continue
            total += int(mod.advise_huge_pages(ptr, data.nbytes))
    return total


def has_avx2() -> bool:
    """Whether the CPU runs the AVX2/FMA kernels (``impl="auto"`` then uses them)."""
    return bool(_ops().has_avx2())


# ---------------------------------------------------------------------------------------------
# The index pytree.
# ---------------------------------------------------------------------------------------------


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["ids", "offsets", "open_codes", "bounds", "mean", "projections"],
    meta_fields=["K", "L"],
)
@dataclasses.dataclass
class HostIndex:
    """MagicPIG's hash tables of one layer in host memory (a pytree of XLA buffers).

    Attributes:
      ids: uint16 ``[B, Hkv, NC, L, CH]`` token ids within each chunk, sorted by bucket.
      offsets: int32 ``[B, Hkv, NC, L, 2^K + 1]`` bucket starts per chunk and table.
      open_codes: uint16 ``[B, Hkv, L, OPEN]`` codes of the open (unsorted) chunk.
      bounds: int32 ``[B, 3]``: (start, end, sealed_end) of the hashed range.
      mean: float32 ``[B, Hkv, D]``, the centering mean (arXiv 2410.16179, Section 4.2).
      projections: float32 ``[D, K*L]``, the SimHash hyperplanes.
      K, L: static LSH parameters.

    See the module docstring for the layout and its memory cost.
    """

    ids: UInt16[Array, "B Hkv NC L CH"]
    offsets: Int[Array, "B Hkv NC L NB"]
    open_codes: UInt16[Array, "B Hkv L OPEN"]
    bounds: Int[Array, "B 3"]
    mean: Float[Array, "B Hkv D"]
    projections: Float[Array, "D KL"]
    K: int
    L: int

    @property
    def start(self) -> jax.Array:
        """int32 ``[B]``: first hashed position."""
        return self.bounds[:, 0]

    @property
    def end(self) -> jax.Array:
        """int32 ``[B]``: one past the last hashed position (grows with appends)."""
        return self.bounds[:, 1]

    @property
    def capacity(self) -> int:
        """Positions the index can hold (``NC * CH``)."""
        return int(self.ids.shape[2] * self.ids.shape[4])

    @property
    def open_capacity(self) -> int:
        """Size of the open chunk."""
        return int(self.open_codes.shape[3])


def index_nbytes(index: HostIndex, include_mean: bool = False) -> int:
    """Bytes of the index buffers (ids + offsets + open chunk + bounds; optionally mean)."""
    n = index.ids.nbytes + index.offsets.nbytes + index.open_codes.nbytes + index.bounds.nbytes
    if include_mean:
        n += index.mean.nbytes + index.projections.nbytes
    return int(n)


def chunk_geometry(capacity: int, chunk_size: int | None = None) -> tuple[int, int]:
    """``(NC, CH)``: chunks covering ``capacity`` positions.

    By default the fewest chunks of ``<= 65536`` positions, balanced; ``chunk_size``
    forces ``CH`` (tests use small chunks to exercise chunk boundaries).
    """
    if chunk_size is not None:
        return -(-capacity // chunk_size), chunk_size
    if capacity <= 0:
        return 0, 1
    nc = -(-capacity // MAX_CHUNK)
    return nc, -(-capacity // nc)


# ---------------------------------------------------------------------------------------------
# Validation helpers.
# ---------------------------------------------------------------------------------------------


def _check_config(config: MagicPIGConfig) -> None:
    if not isinstance(config, MagicPIGConfig):
        raise TypeError(f"config must be a MagicPIGConfig, got {type(config).__name__}")
    if not 1 <= config.K <= HOST_MAX_K:
        raise ValueError(
            f"K must be in [1, {HOST_MAX_K}] for the host index (2^K + 1 bucket offsets per "
            f"chunk and table), got K={config.K}; use the pure-JAX path (attention 'magicpig-ref') for larger K"
        )
    if not 2 <= config.L <= HOST_MAX_L:
        raise ValueError(f"L must be in [2, {HOST_MAX_L}] for the host index, got L={config.L}")


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {name}={value}")
    return int(value)


def _check_lengths_strict(lengths, B: int, N: int, name: str = "lengths") -> jax.Array:
    """Like ``check_lengths``, but concrete values outside ``[0, N]`` raise instead of clipping."""
    if lengths is not None and not isinstance(lengths, jax.core.Tracer):
        arr = np.asarray(lengths)
        if arr.shape == (B,) and np.issubdtype(arr.dtype, np.integer):
            if arr.size and (arr.min() < 0 or arr.max() > N):
                raise ValueError(f"{name} must be in [0, {N}] (the KV capacity), got {arr.tolist()}")
    return check_lengths(lengths, B, N)


def _check_index(index: HostIndex, config: MagicPIGConfig, B: int, Hkv: int, D: int) -> None:
    if not isinstance(index, HostIndex):
        raise TypeError(f"index must be a HostIndex, got {type(index).__name__}")
    if (index.K, index.L) != (config.K, config.L):
        raise ValueError(f"index was built with K={index.K}, L={index.L} but config has K={config.K}, "
                         f"L={config.L}")
    nc, ch = index.ids.shape[2], index.ids.shape[4]
    expect = {
        "ids": ((B, Hkv, nc, config.L, ch), jnp.uint16),
        "offsets": ((B, Hkv, nc, config.L, (1 << config.K) + 1), jnp.int32),
        "open_codes": ((B, Hkv, config.L, index.open_codes.shape[-1]), jnp.uint16),
        "bounds": ((B, 3), jnp.int32),
        "mean": ((B, Hkv, D), jnp.float32),
        "projections": ((D, config.K * config.L), jnp.float32),
    }
    for name, (shape, dtype) in expect.items():
        x = getattr(index, name)
        if tuple(x.shape) != shape or x.dtype != dtype:
            raise ValueError(
                f"index.{name} must be {jnp.dtype(dtype).name} {list(shape)}, got {x.dtype} {list(x.shape)}"
            )


# ---------------------------------------------------------------------------------------------
# log u table.
# ---------------------------------------------------------------------------------------------


def _log_u_exact_f64(p: np.ndarray, K: int, L: int) -> tuple[np.ndarray, np.ndarray]:
    """``(log u, f = log u - 2K log p)`` in float64 (arXiv 2410.16179, Eq. (9))."""
    p = np.clip(np.asarray(p, np.float64), 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_p = np.log(p)
        P = np.exp(K * log_p)
        small = L * P < 0.05
        # Series: u / P^2 = C(L,2) (1-P)^(L-2) sum_m c_m r^m, r = P/(1-P), c_m = C(L,m+2)/C(L,2).
        Ps = np.minimum(P, 0.05 / L)
        r = Ps / (1.0 - Ps)
        term = np.ones_like(Ps)
        total = np.ones_like(Ps)
        for m in range(1, 40):
            term = term * r * (max(L - m - 1, 0) / (m + 2))
            total = total + term
        f_series = math.log(L * (L - 1) / 2.0) + (L - 2) * np.log1p(-Ps) + np.log(total)
        Pc = np.minimum(P, 1.0 - 1e-16)
        l1 = np.log1p(-Pc)
        u = -np.expm1(L * l1) - L * Pc * np.exp((L - 1) * l1)
        log_closed = np.where(P >= 1.0, 0.0, np.log(np.maximum(u, 1e-300)))
        f_closed = log_closed - 2.0 * K * log_p
        f = np.where(small, f_series, f_closed)
        log_u = np.where(small, f_series + 2.0 * K * log_p, log_closed)
    return log_u, f


@functools.lru_cache(maxsize=64)
def _log_u_table_np(K: int, L: int, size: int) -> np.ndarray:
    p = np.arange(size + 1, dtype=np.float64) / size
    _, f = _log_u_exact_f64(p, K, L)
    return f


def log_u_table(K: int, L: int, size: int = LOG_U_TABLE_SIZE) -> np.ndarray:
    """float64 ``[size + 1]``: ``f(p) = log(u / p^(2K))`` at ``p = i / size`` (``f(0)`` = its limit).

    The kernels evaluate ``log u = max(2K log p + f(p), LOG_U_FLOOR)`` with ``f``
    linearly interpolated. ``f`` is smooth on ``[0, 1]`` because ``u / P^2`` is a
    positive polynomial in ``P = p^K``.
    """
    lsh.validate_k_l(K, L)
    return _log_u_table_np(K, L, size)


def log_u_exact(cos: np.ndarray, K: int, L: int) -> np.ndarray:
    """Exact (float64) ``log u`` of cosines, floored at ``LOG_U_FLOOR`` (the tests' yardstick)."""
    c = np.clip(np.asarray(cos, np.float64), -1.0, 1.0)
    p = 1.0 - np.arccos(c) / math.pi
    log_u, _ = _log_u_exact_f64(p, K, L)
    return np.maximum(np.where(p > 0, log_u, -np.inf), LOG_U_FLOOR)


def _table_operand(K: int, L: int) -> jax.Array:
    """The float64 table as uint32 ``[T + 1, 2]`` (its raw bits), so x64 mode is not needed."""
    return jnp.asarray(log_u_table(K, L).view(np.uint32).reshape(-1, 2))


def host_log_u(cos: Float[Array, "..."], K: int, L: int, impl: str = "auto") -> Float[Array, "..."]:
    """``log u`` of cosines through the C++ kernel's table interpolation (for tests).

    Args:
      cos: float32 cosines of any shape, clipped to [-1, 1].
      K, L: the LSH parameters (``1 <= K <= 16``).
      impl: ``"auto"``, ``"scalar"`` or ``"avx2"`` (the vectorized batch the attention
        kernel uses on AVX2 CPUs: A&S 4.4.46 arccos and Cephes' logf polynomial).

    Returns:
      float32 ``log u`` (natural log), floored at ``LOG_U_FLOOR``; same shape as ``cos``.

    Raises:
      ValueError: bad K, L or impl.
    """
    lsh.validate_k_l(K, L)
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {sorted(_IMPLS)}, got {impl!r}")
    if not 1 <= K <= HOST_MAX_K:
        raise ValueError(f"K must be in [1, {HOST_MAX_K}] for the host op, got K={K}")
    _ops()
    cos = jnp.asarray(cos, jnp.float32)
    return jax.ffi.ffi_call(
        "magicpig_host_log_u", jax.ShapeDtypeStruct(cos.shape, jnp.float32), vmap_method="sequential"
    )(cos, _table_operand(K, L), K=np.int64(K), impl=np.int64(_IMPLS[impl]))


# ---------------------------------------------------------------------------------------------
# Build / append.
# ---------------------------------------------------------------------------------------------


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

    The mean and the SimHash codes of the centered keys of ``[num_sink, lengths -
    num_local)`` are computed in JAX exactly as :func:`build_lsh_index` does (it is
    called); the FFI op sorts them into the chunked tables.

    Args:
      k: float ``[B, Hkv, N, D]`` keys.
      projections: float32 ``[D, K*L]``.
      config: :class:`MagicPIGConfig` with ``1 <= K <= 16`` and ``2 <= L <= 4096``.
      lengths: int ``[B]`` valid keys per row (default N); concrete values outside
        ``[0, N]`` raise.
      capacity: positions the index must hold, including later appends
        (default N; must be in ``[N, 2^31 - 1]``).
      open_capacity: size of the open chunk, ``[1, 65536]`` (default 512).
      max_threads: cap on worker threads (0 = XLA's intra-op pool size).
      chunk_size: positions per chunk, ``[1, 65536]`` (default: balanced chunks of
        at most 65536).

    Returns:
      A :class:`HostIndex`.

    Raises:
      TypeError / ValueError: naming the bad parameter and the allowed values.
    """
    _check_config(config)
    if not hasattr(k, "ndim") or k.ndim != 4:
        raise ValueError(f"k must be [B, Hkv, N, D], got shape {tuple(getattr(k, 'shape', ()))}")
    if not jnp.issubdtype(k.dtype, jnp.floating):
        raise TypeError(f"k must be a floating dtype (float32 or bfloat16), got {k.dtype}")
    B, Hkv, N, D = k.shape
    capacity = N if capacity is None else _check_int("capacity", capacity, N, 2**31 - 1)
    open_capacity = _check_int("open_capacity", open_capacity, 1, MAX_CHUNK)
    max_threads = _check_int("max_threads", max_threads, 0, 4096)
    if chunk_size is not None:
        chunk_size = _check_int("chunk_size", chunk_size, 1, MAX_CHUNK)
    lengths = _check_lengths_strict(lengths, B, N)
    if B * Hkv * N * config.K * config.L * 4 <= _CODES_BLOCK_BYTES:
        ref = build_lsh_index(k, projections, config, lengths)
    else:
        ref = _build_lsh_index_blocked(k, projections, config, lengths)
    _ops()
    nc, ch = chunk_geometry(capacity)
    nbk = (1 << config.K) + 1
    out_types = (
        jax.ShapeDtypeStruct((B, Hkv, nc, config.L, ch), jnp.uint16),
        jax.ShapeDtypeStruct((B, Hkv, nc, config.L, nbk), jnp.int32),
        jax.ShapeDtypeStruct((B, Hkv, config.L, open_capacity), jnp.uint16),
        jax.ShapeDtypeStruct((B, 3), jnp.int32),
    )
    ids, offsets, open_codes, bounds = jax.ffi.ffi_call(
        "magicpig_host_build", out_types, vmap_method="sequential"
    )(ref.codes, ref.start.astype(jnp.int32), ref.end.astype(jnp.int32),
      K=np.int64(config.K), max_threads=np.int64(max_threads))
    return HostIndex(ids=ids, offsets=offsets, open_codes=open_codes, bounds=bounds, mean=ref.mean,
                     projections=ref.projections.astype(jnp.float32), K=config.K, L=config.L)


_CODES_BLOCK_BYTES = 512 << 20


def _build_lsh_index_blocked(k, projections, config, lengths):
    """:func:`build_lsh_index` with the codes computed over blocks of positions.

    Same mean and the same per-key formula; bounds the float32 ``[.., N, K*L]``
    projection temporary (6 GB at N=128K, Hkv=8, K*L=1500) to ~512 MB.
    """
    B, Hkv, N, D = k.shape
    small = build_lsh_index(k[:, :, :0], projections, config, jnp.zeros_like(lengths))
    del small  # validates the arguments the same way
    start = jnp.minimum(jnp.int32(config.num_sink), lengths)
    end = jnp.maximum(lengths - jnp.int32(config.num_local), start)
    pos = jnp.arange(N, dtype=jnp.int32)
    in_range = (pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])
    count = jnp.maximum(end - start, 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(in_range[:, None, :, None], k.astype(jnp.float32), 0.0), axis=2)
    mean = mean / count[:, None, None]
    blk = max(1, _CODES_BLOCK_BYTES // (B * Hkv * config.K * config.L * 4))
    nblk = -(-N // blk)
    kp = jnp.pad(k, ((0, 0), (0, 0), (0, nblk * blk - N), (0, 0)))
    kp = jnp.moveaxis(kp.reshape(B, Hkv, nblk, blk, D), 2, 0)

    def codes_of(kb):
        kc = kb.astype(jnp.float32) - mean[:, :, None, :]
        return lsh.simhash_codes(kc, projections, config.K, config.L)

    codes = jax.lax.map(codes_of, kp)  # [nblk, B, Hkv, blk, L]
    codes = jnp.moveaxis(codes, 0, 2).reshape(B, Hkv, nblk * blk, config.L)[:, :, :N]
    return LSHIndex(codes=codes, mean=mean, start=start, end=end, projections=projections)


def host_key_codes(index: HostIndex, k_new: Float[Array, "B Hkv T D"]) -> UInt32[Array, "B Hkv T L"]:
    """SimHash codes of new keys, centered by the index's mean (what :func:`host_append` inserts)."""
    kf = jnp.asarray(k_new).astype(jnp.float32) - index.mean[:, :, None, :]
    return lsh.simhash_codes(kf, index.projections, index.K, index.L)


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
    with the index's mean (arXiv 2410.16179, Section 4.2). The buffers are aliased
    input -> output, so under ``jax.jit`` with the index donated the append is in
    place: O(L) per key, plus a merge of the open chunk into the sorted chunks each
    time it fills. The capacity is static; appending past it fails at run time.

    Args:
      index: the :class:`HostIndex` (donate it under jit).
      k_new: float ``[B, Hkv, T, D]`` the new keys (uncentered).
      counts: int ``[B]`` in ``[0, T]`` (default T).
      max_threads: cap on worker threads (0 = XLA's pool size).

    Returns:
      The updated :class:`HostIndex`.

    Raises:
      TypeError / ValueError: bad shapes, dtypes or counts (run-time errors from the
      op for capacity overflow).
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
    max_threads = _check_int("max_threads", max_threads, 0, 4096)
    if counts is None:
        counts = jnp.full((B,), T, jnp.int32)
    else:
        if not isinstance(counts, jax.core.Tracer):
            c = np.asarray(counts)
            if c.shape != (B,) or not np.issubdtype(c.dtype, np.integer):
                raise ValueError(f"counts must be int [B] = [{B}], got {c.dtype} {list(c.shape)}")
            if c.size and (c.min() < 0 or c.max() > T):
                raise ValueError(f"counts must be in [0, T={T}], got {c.tolist()}")
        counts = jnp.asarray(counts)
        if counts.shape != (B,) or not jnp.issubdtype(counts.dtype, jnp.integer):
            raise ValueError(f"counts must be int [B] = [{B}], got {counts.dtype} {list(counts.shape)}")
        counts = counts.astype(jnp.int32)
    _ops()
    codes = host_key_codes(index, k_new)
    out_types = (
        jax.ShapeDtypeStruct(index.ids.shape, jnp.uint16),
        jax.ShapeDtypeStruct(index.offsets.shape, jnp.int32),
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


# ---------------------------------------------------------------------------------------------
# Sampled attention.
# ---------------------------------------------------------------------------------------------


def host_sampled_attention(
    q: Float[Array, "B Hq D"],
    q_codes: UInt32[Array, "B Hq L"],
    k: Float[Array, "B Hkv N D"],
    v: Float[Array, "B Hkv N D"],
    index: HostIndex,
    lengths: Int[Array, " B"],
    *,
    window: int = 0,
    impl: str = "auto",
    return_mask: bool = False,
    max_threads: int = 0,
):
    """The FFI op alone: attention over the LSH-sampled keys (and unhashed keys before the window).

    For query head h (KV head ``h // (Hq // Hkv)``), the keys of ``[start, end)``
    (and ``< lengths``) whose code equals the query's in >= 2 tables get the logit
    ``q·k/sqrt(D) - log u`` (arXiv 2410.16179, Eq. (4), (9)); the unhashed keys of
    ``[end, lengths - window)`` get the exact logit ``q·k/sqrt(D)`` (not counted as
    sampled). Returns ``(out f32 [B,Hq,D], lse f32 [B,Hq] natural log, num_sampled
    int32 [B,Hq])`` (+ ``mask`` bool ``[B,Hq,N]`` of the sampled keys if
    ``return_mask``); an empty set gives out 0, lse -inf.
    """
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {sorted(_IMPLS)}, got {impl!r}")
    window = _check_int("window", window, 0, 2**31 - 1)
    max_threads = _check_int("max_threads", max_threads, 0, 4096)
    B, Hq, Hkv, N, D = check_qkv(q, k, v)
    if k.dtype != v.dtype or k.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"k and v must both be float32 or both bfloat16, got {k.dtype} and {v.dtype}")
    if q_codes.shape != (B, Hq, index.L) or q_codes.dtype != jnp.uint32:
        raise ValueError(f"q_codes must be uint32 [B, Hq, L] = {[B, Hq, index.L]}, "
                         f"got {q_codes.dtype} {list(q_codes.shape)}")
    _ops()
    table = _table_operand(index.K, index.L)
    out_types = (
        jax.ShapeDtypeStruct((B, Hq, D), jnp.float32),
        jax.ShapeDtypeStruct((B, Hq), jnp.float32),
        jax.ShapeDtypeStruct((B, Hq), jnp.int32),
        jax.ShapeDtypeStruct((B, Hq, N) if return_mask else (0,), jnp.uint8),
    )
    out, lse, ns, mask = jax.ffi.ffi_call("magicpig_host_attention", out_types, vmap_method="sequential")(
        q.astype(jnp.float32), q_codes, k, v, index.ids, index.offsets, index.open_codes, index.bounds,
        index.mean, lengths.astype(jnp.int32), table,
        K=np.int64(index.K), window=np.int64(window), impl=np.int64(_IMPLS[impl]),
        max_threads=np.int64(max_threads),
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
):
    """One decode step of MagicPIG attention with the sampled part on the host (drop-in for
    :func:`magicpig_jax.attention.magicpig_attention`).

    Same semantics as the pure-JAX reference: keys of the hashed range ``[start, end)``
    colliding with the query in >= 2 of L tables enter with logit ``q·k/sqrt(D) - log u``;
    every other valid key (sinks, local window, keys past the index) is exact. The
    sampled part runs in the FFI op; the static part is :func:`dense_attention` in JAX
    over the sinks ``[0, start)`` and the last ``static_window`` positions
    ``[max(end, lengths - static_window), lengths)`` (gathered, so its cost does not
    grow with N); unhashed keys between ``end`` and that window are handled exactly by
    the op. The parts are merged with :func:`merge_attention` (natural-log LSE).

    Args:
      q: float ``[B, Hq, D]``.
      k, v: ``[B, Hkv, N, D]`` float32 or bfloat16 (same dtype).
      host_index: :class:`HostIndex` of this layer (same B, Hkv, D).
      config: the :class:`MagicPIGConfig` the index was built with.
      lengths: int ``[B]`` valid keys per row (default N); concrete values outside
        ``[0, N]`` raise, traced values are clipped.
      static_window: tail positions handled by JAX (default ``num_local + 256``,
        the local window plus the generation buffer), ``>= 0``.
      impl: ``"auto"`` (AVX2 if the CPU has it), ``"scalar"`` or ``"avx2"``.
      return_mask: also return the bool ``[B, Hq, N]`` mask of the sampled keys.
      max_threads: cap on the op's worker threads (0 = XLA's intra-op pool size).

    Returns:
      ``(out, lse, num_sampled)`` (+ ``mask``): out float32 ``[B, Hq, D]``, lse float32
      ``[B, Hq]``, num_sampled int32 ``[B, Hq]``.

    Raises:
      TypeError / ValueError: naming the bad parameter and the allowed values.

    Source: arXiv 2410.16179, Eq. (4) and (9), Sections 4.2-4.3.
    """
    _check_config(config)
    B, Hq, Hkv, N, D = check_qkv(q, k, v)
    if k.dtype != v.dtype or k.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"k and v must both be float32 or both bfloat16, got {k.dtype} and {v.dtype}")
    _check_index(host_index, config, B, Hkv, D)
    if static_window is None:
        static_window = config.num_local + DEFAULT_GENERATION_BUFFER
    static_window = _check_int("static_window", static_window, 0, 2**31 - 1)
    lengths = _check_lengths_strict(lengths, B, N)
    q_codes = lsh.simhash_codes(q, host_index.projections, config.K, config.L)
    res = host_sampled_attention(q, q_codes, k, v, host_index, lengths, window=static_window, impl=impl,
                                 return_mask=return_mask, max_threads=max_threads)
    out, lse = res[0], res[1]
    start, end = host_index.start, host_index.end
    # Sinks [0, start): start <= num_sink by construction.
    ns = min(config.num_sink, N)
    if ns > 0:
        o_s, l_s = dense_attention(q, k[:, :, :ns], v[:, :, :ns], jnp.minimum(start, lengths))
        out, lse = merge_attention(out, lse, o_s, l_s)
    # Tail [max(end, len - W), len): one contiguous slice of W positions per row starting at
    # s = clip(len - W, 0, N - W) (a copy, not a gather), masked to the tail range.
    W = min(static_window, N)
    if W > 0:
        s = jnp.clip(lengths - W, 0, N - W)
        kt = jax.vmap(lambda x, st: jax.lax.dynamic_slice_in_dim(x, st, W, axis=1))(k, s)
        vt = jax.vmap(lambda x, st: jax.lax.dynamic_slice_in_dim(x, st, W, axis=1))(v, s)
        j = jnp.arange(W, dtype=jnp.int32)[None, :] + s[:, None]
        in_tail = (j >= jnp.maximum(end, lengths - W)[:, None]) & (j < lengths[:, None])
        o_t, l_t = masked_softmax_attention(grouped_logits(q, kt), in_tail[:, None, None, :], vt)
        out, lse = merge_attention(out, lse, o_t, l_t)
    if return_mask:
        return out, lse, res[2], res[3]
    return out, lse, res[2]


# Register the FFI targets as soon as this module is imported (the decoder imports it
# whenever the "magicpig" backend runs on the CPU); the ops call _ops() again, a no-op.
_ops()
