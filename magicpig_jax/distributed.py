"""MagicPIG decoding sharded over devices: the batch and the KV heads split with ``jax.sharding``.

The KV cache ``[B, Hkv, N, D]``, the host index of a layer and the decode query
``[B, Hq, D]`` are split over a 2-D device mesh with axes ``("batch", "kv_heads")``;
:func:`jax.shard_map` runs the host op (:mod:`magicpig_jax.host`) on every device with
its own shard, so no device ever sees another device's keys and nothing is gathered:
the compiled program has no collective at all (``tests/test_distributed.py`` checks the
HLO). The split is GQA-consistent: query head ``h`` reads KV head ``h // G``, and the
query heads are split into the same number of contiguous blocks as the KV heads, so
block ``j`` holds exactly the ``G`` query heads of each of its KV heads.

Per decode step and layer (arXiv 2410.16179, Section 4.3)::

    mesh  = make_mesh(batch=2, kv_heads=4)                     # 8 devices
    k, v  = shard_kv(mesh, k), shard_kv(mesh, v)               # [B, Hkv, N, D]
    index = sharded_build_index(mesh, k, proj, config, lengths, capacity=N)   # after prefill
    out, lse, num_sampled = sharded_magicpig_attention(mesh, q, k, v, index, config, lengths)
    index = sharded_append(mesh, index, k_new, counts)        # generated keys leaving the buffer

Each function equals its single-device counterpart (``host_build_index``,
``host_magicpig_attention``, ``host_append``) shard by shard: the mean, the codes, the
sampled sets and every per-row quantity depend only on that (row, KV head). Every
function also works under ``jax.jit`` (the mesh and the config are static).

Requirements: ``B`` divisible by the mesh's ``batch`` size and ``Hkv`` by its ``kv_heads``
size; the devices are CPU devices (the host op is an XLA FFI custom call registered for
the CPU platform). On one machine, several CPU devices are made with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before JAX initializes; each
device then runs its op on its own shard concurrently.

Multi-host: start one process per host, each calling, before any other JAX call::

    import jax
    jax.distributed.initialize(coordinator_address="host0:1234",   # same on every process
                               num_processes=4, process_id=RANK)    # RANK = 0..3
    from magicpig_jax.distributed import make_mesh
    mesh = make_mesh(batch=jax.process_count(), kv_heads=len(jax.local_devices()))

``jax.devices()`` then lists every process's devices and the mesh spans all of them
(``make_mesh`` puts each process's devices in one row of the ``batch`` axis, so a
process holds whole batch rows). Each process builds the global arrays from the rows it
holds with ``jax.make_array_from_process_local_data(NamedSharding(mesh, KV_SPEC), local_k)``
(likewise ``Q_SPEC`` for the query, ``ROW_SPEC`` for the lengths) and calls the same
functions; the shard_map runs each process's shards on its own devices with no
cross-host traffic (no collective). Read results back per process from
``out.addressable_shards``, or gather them with
``jax.experimental.multihost_utils.process_allgather(out)``. Environment variables
(``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) or a cluster
launcher (SLURM, Open MPI) can replace the arguments of ``initialize``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from magicpig_jax import host
from magicpig_jax.attention._common import check_softcap
from magicpig_jax.attention.config import MagicPIGConfig
from magicpig_jax.host._ext import impl_code
from magicpig_jax.host.validate import check_config, check_index, check_int

__all__ = [
    "BATCH",
    "KV_HEADS",
    "Q_SPEC",
    "KV_SPEC",
    "ROW_SPEC",
    "HEAD_SPEC",
    "make_mesh",
    "host_index_spec",
    "shard",
    "shard_kv",
    "shard_q",
    "shard_rows",
    "shard_host_index",
    "canonical_placement",
    "sharded_build_index",
    "sharded_append",
    "sharded_magicpig_attention",
]

BATCH = "batch"
KV_HEADS = "kv_heads"
Q_SPEC = P(BATCH, KV_HEADS, None)  # q, out [B, Hq, D]: query heads in KV-group blocks
KV_SPEC = P(BATCH, KV_HEADS, None, None)  # k, v [B, Hkv, N, D]
ROW_SPEC = P(BATCH)  # lengths, counts [B]
HEAD_SPEC = P(BATCH, KV_HEADS)  # lse, num_sampled [B, Hq]


def make_mesh(batch: int | None = None, kv_heads: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``("batch", "kv_heads")`` mesh of ``batch * kv_heads`` devices.

    Args:
      batch: devices along the batch axis (default: ``len(devices) // kv_heads``).
      kv_heads: devices along the KV-head axis.
      devices: the devices, in row-major mesh order (default ``jax.devices()``, which
        lists the devices of each process contiguously, so with ``kv_heads`` = the
        local device count every process owns one row of the batch axis).

    Raises:
      ValueError: the sizes are not positive, need more devices than given, or the mesh would
        hold a device twice.
    """
    devices = list(jax.devices() if devices is None else devices)

    def positive_int(x) -> bool:  # a Python or NumPy integer, not a bool
        return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_) and x >= 1

    if not positive_int(kv_heads):
        raise ValueError(f"kv_heads must be a positive int, got {kv_heads!r}")
    kv_heads = int(kv_heads)
    if batch is None:
        if kv_heads > len(devices):
            raise ValueError(f"kv_heads={kv_heads} needs at least {kv_heads} devices, have {len(devices)}")
        batch = len(devices) // kv_heads
    if not positive_int(batch):
        raise ValueError(f"batch must be a positive int, got {batch!r} (with {len(devices)} devices)")
    batch = int(batch)
    if batch * kv_heads > len(devices):
        hint = (" (on a CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)"
                if all(getattr(d, "platform", None) == "cpu" for d in devices) else "")
        raise ValueError(f"a {batch} x {kv_heads} mesh needs {batch * kv_heads} devices, have {len(devices)}{hint}")
    used = devices[: batch * kv_heads]
    repeated = sorted({str(d) for d in used if used.count(d) > 1})
    if repeated:
        raise ValueError(f"devices must be distinct: {', '.join(repeated)} appear more than once in the "
                         f"{batch} x {kv_heads} mesh")
    grid = np.array(used, dtype=object).reshape(batch, kv_heads)
    return Mesh(grid, (BATCH, KV_HEADS))


def host_index_spec(K: int, L: int, num_sink: int | None, num_local: int | None) -> host.HostIndex:
    """The PartitionSpec pytree of a :class:`~magicpig_jax.host.HostIndex` (rows and KV heads split).

    Its static fields must be the index's, since a pytree's structure includes them: ``K``, ``L``,
    ``num_sink`` and ``num_local`` of the config the index was built with (``host_build_index``
    records them; None for an index assembled by hand without them).
    """
    return host.HostIndex(
        ids=P(BATCH, KV_HEADS), offsets=P(BATCH, KV_HEADS), open_codes=P(BATCH, KV_HEADS),
        bounds=P(BATCH), mean=P(BATCH, KV_HEADS), projections=P(), K=K, L=L, num_sink=num_sink,
        num_local=num_local,
    )


def _spec_of(index: host.HostIndex) -> host.HostIndex:
    return host_index_spec(index.K, index.L, index.num_sink, index.num_local)


def shard(mesh: Mesh, x, spec: P) -> jax.Array:
    """``jax.device_put(x, NamedSharding(mesh, spec))``."""
    return jax.device_put(x, NamedSharding(mesh, spec))


def shard_kv(mesh: Mesh, x) -> jax.Array:
    """Place a ``[B, Hkv, N, D]`` cache array: rows over ``batch``, KV heads over ``kv_heads``."""
    return shard(mesh, x, KV_SPEC)


def shard_q(mesh: Mesh, q) -> jax.Array:
    """Place a ``[B, Hq, D]`` query: rows over ``batch``, query heads in KV-group blocks."""
    return shard(mesh, q, Q_SPEC)


def shard_rows(mesh: Mesh, x) -> jax.Array:
    """Place a per-row ``[B]`` array (lengths, counts) over ``batch``."""
    return shard(mesh, x, ROW_SPEC)


def shard_host_index(mesh: Mesh, index: host.HostIndex) -> host.HostIndex:
    """Place a host index built on one device onto the mesh (projections replicated)."""
    specs = _spec_of(index)
    return jax.tree.map(lambda x, s: shard(mesh, x, s), index, specs)


def canonical_placement(mesh: Mesh, tree):
    """``tree`` with each array on ``mesh`` re-labelled with its spec's axes of size 1 and trailing
    ``None`` dropped.

    ``P("batch", "kv_heads", None, None)`` and ``P("batch", "kv_heads")`` place an array
    identically, and so do ``P("batch", "kv_heads")`` and ``P("batch")`` on a mesh whose
    ``kv_heads`` axis has size 1, but jit keys its compiled programs by the spec as written
    (and writes its outputs' specs in the short form): a decode step whose first inputs carry
    the long form (:data:`KV_SPEC`, an index built by a ``shard_map``) and whose later inputs
    are its own outputs compiled twice.
    The arrays are not copied (the placement is the same). An uncommitted array (one JAX may
    place anywhere, e.g. the ``[D, 0]`` placeholder of a layer that shares its SimHash matrix)
    is replicated over ``mesh``, where the step's outputs put it; other arrays not on ``mesh``
    are returned as they are.
    """

    def place(x):
        sharding = getattr(x, "sharding", None)
        if isinstance(x, jax.Array) and not x.committed:
            return jax.device_put(x, NamedSharding(mesh, P()))
        if not isinstance(sharding, NamedSharding) or sharding.mesh != mesh:
            return x
        spec = tuple(None if a is not None and all(mesh.shape[n] == 1 for n in (a if isinstance(a, tuple) else (a,)))
                     else a for a in sharding.spec)
        while spec and spec[-1] is None:
            spec = spec[:-1]
        return x if spec == tuple(sharding.spec) else jax.device_put(x, NamedSharding(mesh, P(*spec)))

    return jax.tree.map(place, tree)


def _sizes(mesh: Mesh) -> tuple[int, int]:
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != (BATCH, KV_HEADS):
        what = f"axes {tuple(mesh.axis_names)!r}" if isinstance(mesh, Mesh) else repr(mesh)
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes ('batch', 'kv_heads'), got {what}")
    return mesh.shape[BATCH], mesh.shape[KV_HEADS]


def check_split(mesh: Mesh, B: int, Hkv: int, Hq: int | None = None) -> None:
    """Refuse a batch or KV-head count that the mesh's ``batch`` / ``kv_heads`` axes do not divide.

    Raises:
      ValueError: naming the count and the axis (and Hq not a multiple of Hkv, when given).
    """
    nb, nh = _sizes(mesh)
    if B % nb:
        raise ValueError(f"batch size B={B} is not divisible by the mesh's 'batch' axis ({nb} devices)")
    if Hkv % nh:
        raise ValueError(f"KV heads Hkv={Hkv} are not divisible by the mesh's 'kv_heads' axis ({nh} devices)")
    if Hq is not None and (Hkv == 0 or Hq % Hkv):
        raise ValueError(f"Hq ({Hq}) must be a multiple of Hkv ({Hkv}) for GQA")


def _placed(mesh: Mesh, x, spec: P):
    """``x`` on ``mesh`` with ``spec``: a concrete array placed elsewhere (committed to one device,
    or another sharding) is moved, as the docstrings promise; a tracer is left to jit's constraints."""
    if isinstance(x, jax.core.Tracer):
        return x
    return jax.device_put(x, NamedSharding(mesh, spec))


def _check_rows(name: str, x, B: int, N: int | None) -> None:
    """Concrete per-row values are checked here with the global shapes (inside the shard_map
    they are tracers, which the host op clips instead of rejecting)."""
    if x is None or isinstance(x, jax.core.Tracer):
        return
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        # several processes (make_array_from_process_local_data): the values live on other hosts,
        # so only the shape and dtype are checked here; the host op clips the values
        if tuple(x.shape) != (B,) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be int [B] = [{B}], got {x.dtype} {list(x.shape)}")
        return
    arr = np.asarray(x)
    if arr.shape != (B,) or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be int [B] = [{B}], got {arr.dtype} {list(arr.shape)}")
    if N is not None and arr.size and (arr.min() < 0 or arr.max() > N):
        raise ValueError(f"{name} must be in [0, {N}], got {arr.tolist()}")


@functools.partial(jax.jit, static_argnames=("mesh", "config", "capacity", "open_capacity", "chunk_size",
                                             "max_threads"))
def _build(k, projections, lengths, *, mesh, config, capacity, open_capacity, chunk_size, max_threads):
    def local(k, projections, lengths):
        return host.host_build_index(k, projections, config, lengths, capacity=capacity,
                                     open_capacity=open_capacity, max_threads=max_threads,
                                     chunk_size=chunk_size)

    return jax.shard_map(local, mesh=mesh, in_specs=(KV_SPEC, P(), ROW_SPEC),
                         out_specs=host_index_spec(config.K, config.L, config.num_sink, config.num_local),
                         check_vma=False)(k, projections, lengths)


def sharded_build_index(
    mesh: Mesh,
    k: jax.Array,
    projections: jax.Array,
    config: MagicPIGConfig,
    lengths: jax.Array | None = None,
    *,
    capacity: int | None = None,
    open_capacity: int = host.DEFAULT_OPEN_CAPACITY,
    chunk_size: int | None = None,
    max_threads: int = 0,
) -> host.HostIndex:
    """:func:`magicpig_jax.host.host_build_index` with each device indexing its own (rows, KV heads).

    Args:
      mesh: a ``("batch", "kv_heads")`` mesh (:func:`make_mesh`).
      k: float ``[B, Hkv, N, D]`` keys (ideally already placed with :func:`shard_kv`;
        otherwise they are moved to their shards, each device receiving only its part).
      projections: float32 ``[D, K*L]`` (replicated on every device).
      config: the :class:`MagicPIGConfig` (``K <= 16``).
      lengths: int ``[B]`` valid keys per row (default N).
      capacity, open_capacity, chunk_size, max_threads: as for ``host_build_index``
        (``max_threads`` caps each device's op).

    Returns:
      A :class:`~magicpig_jax.host.HostIndex` whose buffers are sharded like ``k``
      (``bounds`` over ``batch``, ``projections`` replicated), equal to the
      single-device index.

    Raises:
      ValueError / TypeError: a bad mesh, a split that does not divide ``B`` or ``Hkv``,
      or any error of ``host_build_index``.
    """
    check_config(config)
    if not hasattr(k, "ndim") or k.ndim != 4:
        raise ValueError(f"k must be [B, Hkv, N, D], got shape {tuple(getattr(k, 'shape', ()))}")
    B, Hkv, N, D = k.shape
    check_split(mesh, B, Hkv)
    _check_rows("lengths", lengths, B, N)
    if capacity is not None:
        check_int("capacity", capacity, N, 2**31 - 1)
    if projections.shape != (D, config.K * config.L):
        raise ValueError(f"projections must be [D, K*L] = [{D}, {config.K * config.L}], "
                         f"got {tuple(projections.shape)}")
    lengths = jnp.full((B,), N, jnp.int32) if lengths is None else jnp.asarray(lengths).astype(jnp.int32)
    k, projections = _placed(mesh, k, KV_SPEC), _placed(mesh, jnp.asarray(projections, jnp.float32), P())
    return _build(k, projections, _placed(mesh, lengths, ROW_SPEC), mesh=mesh, config=config,
                  capacity=capacity, open_capacity=open_capacity, chunk_size=chunk_size, max_threads=max_threads)


@functools.partial(jax.jit, static_argnames=("mesh", "max_threads"), donate_argnames=("index",))
def _append(index, k_new, counts, *, mesh, max_threads):
    def local(index, k_new, counts):
        return host.host_append(index, k_new, counts, max_threads=max_threads)

    spec = _spec_of(index)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, KV_SPEC, ROW_SPEC), out_specs=spec,
                         check_vma=False)(index, k_new, counts)


def sharded_append(
    mesh: Mesh,
    index: host.HostIndex,
    k_new: jax.Array,
    counts: jax.Array | None = None,
    *,
    max_threads: int = 0,
) -> host.HostIndex:
    """:func:`magicpig_jax.host.host_append` on every shard (the index is donated: updated in place).

    Args:
      mesh: the mesh the index was built on.
      index: a sharded :class:`~magicpig_jax.host.HostIndex` (invalid after the call).
      k_new: float ``[B, Hkv, T, D]`` new keys (uncentered).
      counts: int ``[B]`` keys appended per row, in ``[0, T]`` (default T).
      max_threads: cap on each device's worker threads.

    Returns:
      The updated, identically sharded index.

    Raises:
      ValueError / TypeError: as :func:`sharded_build_index` and ``host_append``.
    """
    if not isinstance(index, host.HostIndex):
        raise TypeError(f"index must be a HostIndex, got {type(index).__name__}")
    if not hasattr(k_new, "ndim") or k_new.ndim != 4:
        raise ValueError(f"k_new must be [B, Hkv, T, D], got shape {tuple(getattr(k_new, 'shape', ()))}")
    B, Hkv, T, D = k_new.shape
    check_split(mesh, B, Hkv)
    if index.mean.shape != (B, Hkv, D):
        raise ValueError(f"k_new {tuple(k_new.shape)} does not match the index (mean {tuple(index.mean.shape)})")
    _check_rows("counts", counts, B, T)
    counts = jnp.full((B,), T, jnp.int32) if counts is None else jnp.asarray(counts).astype(jnp.int32)
    _check_room(index, counts)
    # onto their shards, as sharded_build_index and sharded_magicpig_attention place theirs (an array
    # committed to one device was refused by jit as on incompatible devices)
    k_new, counts = _placed(mesh, k_new, KV_SPEC), _placed(mesh, counts, ROW_SPEC)
    return _append(index, k_new, counts, mesh=mesh, max_threads=max_threads)


def _check_room(index: host.HostIndex, counts) -> None:
    """Refuse an append past the capacity naming the global row: inside the shard_map the host op
    sees its shard's rows only, and would name the row by its index there."""
    arrays = (index.bounds, counts)
    if any(isinstance(a, jax.core.Tracer) or (isinstance(a, jax.Array) and not a.is_fully_addressable)
           for a in arrays):
        return  # traced, or values on other hosts: the host op checks them
    end, cnt = np.asarray(index.end).astype(np.int64), np.asarray(counts).astype(np.int64)
    over = np.flatnonzero(end + cnt > index.capacity)
    if over.size:
        b = int(over[0])
        raise ValueError(f"appending {int(cnt[b])} keys to row {b} at position {int(end[b])} exceeds the index "
                         f"capacity {index.capacity}")


@functools.partial(jax.jit, static_argnames=("mesh", "config", "static_window", "impl", "max_threads", "softcap"))
def _attention(q, k, v, index, lengths, *, mesh, config, static_window, impl, max_threads, softcap=None):
    def local(q, k, v, index, lengths):
        return host.host_magicpig_attention(q, k, v, index, config, lengths, static_window=static_window,
                                            impl=impl, max_threads=max_threads, softcap=softcap)

    return jax.shard_map(
        local, mesh=mesh,
        in_specs=(Q_SPEC, KV_SPEC, KV_SPEC, _spec_of(index), ROW_SPEC),
        out_specs=(Q_SPEC, HEAD_SPEC, HEAD_SPEC), check_vma=False,
    )(q, k, v, index, lengths)


def sharded_magicpig_attention(
    mesh: Mesh,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    host_index: host.HostIndex,
    config: MagicPIGConfig,
    lengths: jax.Array | None = None,
    *,
    static_window: int | None = None,
    impl: str = "auto",
    max_threads: int = 0,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decode step of :func:`magicpig_jax.host.host_magicpig_attention`, each device on its shard.

    The query heads are split in KV-group blocks (``Q_SPEC``), so the ``G`` query heads
    of a KV head sit on the device holding that KV head's keys, values and tables. The
    static part (sinks, local window, generated tokens) and the LSE merge run on the
    same device; nothing is gathered.

    Args:
      mesh: a ``("batch", "kv_heads")`` mesh (:func:`make_mesh`).
      q: float ``[B, Hq, D]``.
      k, v: ``[B, Hkv, N, D]`` float32 or bfloat16, best placed with :func:`shard_kv` (arrays
        placed otherwise are moved to their shards first).
      host_index: the layer's index from :func:`sharded_build_index` (or
        :func:`shard_host_index`).
      config: the :class:`MagicPIGConfig` the index was built with.
      lengths: int ``[B]`` valid keys per row (default N).
      static_window, impl, max_threads, softcap: as for ``host_magicpig_attention``.

    Returns:
      ``(out float32 [B, Hq, D], lse float32 [B, Hq], num_sampled int32 [B, Hq])``,
      sharded like ``q``; equal to the single-device ``host_magicpig_attention``.

    Raises:
      ValueError / TypeError: a bad mesh or split, or any error of ``host_magicpig_attention``.
    """
    check_config(config)
    for name, x, nd in (("q", q, 3), ("k", k, 4), ("v", v, 4)):
        if not hasattr(x, "ndim") or x.ndim != nd:
            raise ValueError(f"{name} must have {nd} dimensions, got shape {tuple(getattr(x, 'shape', ()))}")
    B, Hkv, N, D = k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape [B, Hkv, N, D] = {tuple(k.shape)}, got {tuple(v.shape)}")
    if q.shape[0] != B or q.shape[2] != D:
        raise ValueError(f"q must be [B, Hq, D] with k's B = {B} and D = {D}, got {tuple(q.shape)}")
    check_split(mesh, B, Hkv, q.shape[1])
    if not isinstance(host_index, host.HostIndex):
        raise TypeError(f"host_index must be a HostIndex, got {type(host_index).__name__}")
    check_index(host_index, config, B, Hkv, D)
    _check_rows("lengths", lengths, B, N)
    if static_window is None:
        static_window = config.static_window()
    static_window = check_int("static_window", static_window, 0, 2**31 - 1)
    impl_code(impl)
    softcap = check_softcap(softcap)
    lengths = jnp.full((B,), N, jnp.int32) if lengths is None else jnp.asarray(lengths).astype(jnp.int32)
    q, k, v, lengths = (_placed(mesh, q, Q_SPEC), _placed(mesh, k, KV_SPEC), _placed(mesh, v, KV_SPEC),
                        _placed(mesh, lengths, ROW_SPEC))
    return _attention(q, k, v, host_index, lengths, mesh=mesh, config=config, static_window=static_window,
                      impl=impl, max_threads=max_threads, softcap=softcap)
