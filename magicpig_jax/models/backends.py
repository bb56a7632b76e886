"""Decode attention backends of the Llama decoder: one table, one entry per method.

Every sparse backend keeps the static set exact — the first ``num_sink`` tokens, the last
``num_local`` prompt tokens and the generated tokens not yet in the sampled set — and applies
its method to the hashed range ``[start, end)`` of :meth:`MagicPIGConfig.hashed_range`, so the
methods are compared like for like (arXiv 2410.16179, Section 5).

Each :class:`Backend` has four parts, called by the decoder in this order:

  build       (inside jit, after prefill) the per-layer decode state of a sparse layer;
  prepare     (outside jit, once) place the cache and that state in memory (huge pages for
              the host op; the host device for offload) and return them;
  attend      (inside the decode step) ``(out, lse, keys_used)`` of a sparse layer;
  after_step  (inside the decode step, after the cache write) update the state
              (the host index appends generated tokens when a generation buffer is due).

``attend_dense`` is the exact attention of the layers kept dense under the backend;
``make_step``, when set, replaces the jitted decode step (offload runs each step as a
sequence of accelerator and host computations, :mod:`magicpig_jax.offload`).
:func:`backend_for` is the one place that chooses the entry for a :class:`DecodeSpec`:

  dense         exact attention over every cached key (no sparse layer).
  magicpig      LSH sampling; on the CPU backend the index and the sampled attention run in
                the host op (:mod:`magicpig_jax.host`); on a GPU/TPU backend the paper's
                system: the sparse layers' KV cache and index in host memory, the host op
                there, everything else on the accelerator ("magicpig-offload").
  magicpig-ref  LSH sampling, pure-JAX reference (:func:`magicpig_attention`).
  topk          exact TopK of the hashed range (``budget`` keys); on the CPU backend the host op
                (:mod:`magicpig_jax.host.topk`: every key scored, a partial selection), else pure JAX.
  quest         Quest page selection in the hashed range (``budget`` keys, ``page_size`` pages); on
                the CPU backend the host op over page bounds kept with the cache
                (:mod:`magicpig_jax.host.quest`), else pure JAX.
  oracle        oracle sampling (Def. 3.1) of ``budget`` draws from the hashed range.
  hybrid        the hybrid LSH estimator (:mod:`magicpig_jax.attention.hybrid`): keys that collide
                in ``>= heavy`` tables kept exactly, the rest weighted by ``1/u_c`` (pure JAX).

The host entries of TopK and Quest move generated tokens into the range on MagicPIG's schedule
(:func:`append_due`), so their static part is a bounded window, as the host MagicPIG's is; the
pure-JAX entries keep the range of the prefill. The two give the same results while no append
is due (the first ``static_window - num_local`` generated tokens).

A :class:`~magicpig_jax.attention.LayerConfigs` in :attr:`DecodeSpec.layers` gives each layer its
own MagicPIG configuration (or keeps it dense): the chosen entry is wrapped (:func:`per_layer`) so
that each layer's state carries its configuration.

With a mesh (:func:`magicpig_jax.distributed.make_mesh`) the host entry is wrapped so each
device runs the op on its shard of rows and KV heads (:func:`sharded`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from magicpig_jax import lsh
from magicpig_jax.attention import (
    GENERATION_BUFFER,
    LSHIndex,
    MagicPIGConfig,
    budget_tokens,
    build_lsh_index,
    dense_attention,
    magicpig_attention,
    merge_attention,
    oracle_sampling_attention,
    quest_attention,
    static_attention,
    topk_attention,
)
from magicpig_jax.attention.baselines import check_budget, check_page_size
from magicpig_jax.attention.hybrid import HybridConfig, hybrid_attention
from magicpig_jax.attention.layer_configs import LayerConfigs

__all__ = ["BACKENDS", "BUDGETED", "HOST_BACKENDS", "Backend", "DecodeSpec", "LayerState", "MiddleRange",
           "append_due", "backend_for", "layer_projections", "per_layer"]

BACKENDS = ("dense", "magicpig", "magicpig-ref", "topk", "quest", "oracle", "hybrid")
BUDGETED = ("topk", "quest", "oracle")
HOST_BACKENDS = ("magicpig", "topk", "quest")  # the backends with a host op (CPU backend)
LAYERED = ("magicpig", "magicpig-ref", "hybrid")  # the backends that take per-layer LayerConfigs


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Static description of the decode attention (hashable; a jit static argument).

    Attributes:
      backend: one of :data:`BACKENDS`.
      magicpig: the :class:`MagicPIGConfig`; its ``num_sink``/``num_local`` define the
        static set of every sparse backend, K/L/seed are MagicPIG's.
      dense_layers: layer indices kept dense under a sparse backend (exact attention, in
        the host op when the sparse layers use it).
      budget: keys per query head for "topk"/"quest"/"oracle": an ``int`` token count
        or a ``float`` in (0, 1], a fraction of the hashed range.
      page_size: Quest's page size (tokens).
      generation_buffer: (host op) generated tokens stay static until the unhashed tail
        reaches :attr:`static_window` positions; then the oldest ``generation_buffer`` of
        them are appended to the index in one call.
      host: whether "magicpig" runs through the host op on the CPU backend (default: iff
        JAX's default backend is the CPU).
      mesh: optional ``("batch", "kv_heads")`` mesh for the host op (None: one device).
      offload: whether "magicpig" runs as the host-offload system (:mod:`magicpig_jax.offload`):
        the sparse layers' KV cache and index on ``host_device``, the rest on the accelerator
        (JAX's default device). Default: iff JAX's default backend is not the CPU.
      host_device: the CPU device that holds the offloaded cache and runs the host op
        (default ``jax.devices("cpu")[0]``; the tests pass a second virtual CPU device so that
        two CPU devices stand in for the accelerator and the host).
      layers: optional :class:`~magicpig_jax.attention.LayerConfigs` (``magicpig``,
        ``magicpig-ref``, ``hybrid``): each layer's own config or ``"dense"``; then ``magicpig``
        must be ``layers.base()`` and ``dense_layers`` its dense layers.

    Raises:
      ValueError: unknown backend, a budgeted backend without a budget, or a configuration
        the chosen backend cannot run (e.g. K > 16 on the host op).
    """

    backend: str = "dense"
    magicpig: MagicPIGConfig = MagicPIGConfig()
    dense_layers: tuple[int, ...] = ()
    budget: int | float | None = None
    page_size: int = 16
    generation_buffer: int = GENERATION_BUFFER
    host: bool | None = None
    mesh: jax.sharding.Mesh | None = None
    offload: bool | None = None
    host_device: jax.Device | None = None
    layers: LayerConfigs | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"attention backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend in BUDGETED:
            if self.budget is None:
                raise ValueError(f"attention backend {self.backend!r} needs a budget (tokens or a fraction)")
            check_budget(self.budget)
            check_page_size(self.page_size)
        if self.generation_buffer < 1:
            raise ValueError(f"generation_buffer must be >= 1, got {self.generation_buffer}")
        if self.layers is not None:
            _check_layers(self)
        if self.offload is None:
            object.__setattr__(self, "offload", self.backend == "magicpig" and self.mesh is None
                               and self.layers is None and jax.default_backend() != "cpu")
        if self.offload and (self.backend != "magicpig" or self.mesh is not None):
            raise ValueError("offload runs the 'magicpig' backend on one accelerator (no mesh), "
                             f"got backend={self.backend!r}, mesh={self.mesh}")
        if self.host_device is not None and self.host_device.platform != "cpu":
            raise ValueError(f"host_device must be a CPU device, got {self.host_device}")
        if self.host is None:
            object.__setattr__(self, "host", self.backend in HOST_BACKENDS and not self.offload
                               and jax.default_backend() == "cpu")
        backend_for(self).validate(self)

    @property
    def uses_host(self) -> bool:
        """True when the sparse layers run through the host op in the jitted step (CPU backend)."""
        return bool(self.host) and self.backend in HOST_BACKENDS and not self.offload

    def offload_devices(self) -> tuple[jax.Device, jax.Device]:
        """``(accelerator, host)`` of the offload system: JAX's default device and :attr:`host_device`."""
        return jax.devices()[0], self.host_device or jax.devices("cpu")[0]

    def with_config(self, config: MagicPIGConfig) -> DecodeSpec:
        """This spec for one layer of :attr:`layers`: ``magicpig = config``, no per-layer table."""
        return dataclasses.replace(self, magicpig=config, layers=None)

    @property
    def static_window(self) -> int:
        """The longest unhashed tail (:meth:`MagicPIGConfig.static_window` of this generation buffer)."""
        return self.magicpig.static_window(self.generation_buffer)

    def sparse_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers that use the sparse backend (all but ``dense_layers``; none for "dense")."""
        if self.backend == "dense":
            return ()
        return tuple(i for i in range(num_layers) if i not in set(self.dense_layers))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MiddleRange:
    """The hashed range ``[start, end)`` of each row, fixed after prefill (int32 ``[B]`` each).

    The decode state of the TopK, Quest and oracle backends: they apply their method to
    these keys, as MagicPIG samples them.
    """

    start: jax.Array
    end: jax.Array

    @classmethod
    def from_lengths(cls, lengths: jax.Array, config: MagicPIGConfig) -> MiddleRange:
        """The range of :meth:`MagicPIGConfig.hashed_range`."""
        start, end = config.hashed_range(lengths)
        return cls(start=start, end=end)


def layer_projections(config: MagicPIGConfig, layer: int, head_dim: int) -> jax.Array:
    """SimHash projections of one layer: ``simhash_projections(fold_in(key(seed), layer), D, K, L)``."""
    key = jax.random.fold_in(jax.random.key(config.seed), layer)
    return lsh.simhash_projections(key, head_dim, config.K, config.L)


# The signatures of a backend's parts (q [B, Hq, D], k/v [B, Hkv, N, D], lengths int32 [B]).
BuildFn = Callable[["DecodeSpec", jax.Array, jax.Array, int, int], Any]  # (spec, k, lengths, layer, capacity)
AttendFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]  # (spec, q, k, v, state, lengths, key)
AfterStepFn = Callable[["DecodeSpec", Any, jax.Array, jax.Array], Any]  # (spec, state, k, lengths)
PrepareFn = Callable[..., tuple[Any, tuple]]  # (spec, cache, states) -> (cache, states)
DenseFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def _keep(spec, state, k, lengths):
    return state


def _in_place(spec, cache, states):
    return cache, states


def _accept(spec) -> None:
    return None


def _no_sparse_layer(*args, **kwargs):
    raise ValueError("the 'dense' backend has no sparse layer")


@dataclasses.dataclass(frozen=True)
class Backend:
    """One decode attention method: how the decoder builds, places, uses and updates its state.

    Attributes:
      name: the backend's name (for messages and stats).
      build: ``(spec, k, lengths, layer, capacity) -> state`` of one sparse layer.
      attend: ``(spec, q, k, v, state, lengths, key) -> (out f32 [B,Hq,D], lse f32 [B,Hq],
        keys_used int32 [B,Hq])``; keys_used counts the sampled (magicpig), selected
        (topk/quest) or distinct drawn (oracle) keys of the hashed range.
      after_step: ``(spec, state, k, lengths) -> state`` after the step wrote its token
        (``lengths`` counts it).
      prepare: ``(spec, cache, states) -> (cache, states)`` once after build, outside jit: the
        cache and per-layer states the decode steps use (the same objects, or re-placed ones).
      attend_dense: ``(q, k, v, lengths) -> (out, lse)`` for the layers kept dense.
      validate: ``(spec) -> None``, raises ValueError for a configuration it cannot run.
      make_step: ``(graphdef, state_treedef, spec) -> step`` replacing the jitted decode step of
        :func:`~magicpig_jax.models.decoding.compiled_decode_step` (same call and results), or None.
    """

    name: str
    build: BuildFn
    attend: AttendFn
    after_step: AfterStepFn = _keep
    prepare: PrepareFn = _in_place
    attend_dense: DenseFn = dense_attention
    validate: Callable[[DecodeSpec], None] = _accept
    make_step: Callable | None = None


# ------------------------------------------------------------------------------------------
# Pure-JAX MagicPIG.
# ------------------------------------------------------------------------------------------


def _build_reference(spec, k, lengths, layer, capacity):
    return build_lsh_index(k, layer_projections(spec.magicpig, layer, k.shape[-1]), spec.magicpig, lengths)


def _attend_reference(spec, q, k, v, state: LSHIndex, lengths, key):
    return magicpig_attention(q, k, v, state, spec.magicpig, lengths)


# ------------------------------------------------------------------------------------------
# TopK, Quest and oracle sampling of the hashed range, plus the exact static set.
# ------------------------------------------------------------------------------------------


def _build_range(spec, k, lengths, layer, capacity):
    return MiddleRange.from_lengths(lengths, spec.magicpig)


def _attend_range(method: str, spec, q, k, v, state: MiddleRange, lengths, key):
    # A non-empty hashed range always starts at num_sink (start = min(num_sink, length) and
    # end > start only when length > num_sink), so the range is a static slice of the cache.
    s0 = min(spec.magicpig.num_sink, k.shape[2])
    mk, mv = k[:, :, s0:], v[:, :, s0:]
    mid_len = jnp.maximum(jnp.minimum(state.end, lengths) - s0, 0)
    if method == "topk":
        out, lse = topk_attention(q, mk, mv, spec.budget, mid_len)
        used = jnp.minimum(budget_tokens(spec.budget, mid_len), mid_len)
    elif method == "quest":
        out, lse = quest_attention(q, mk, mv, spec.page_size, spec.budget, mid_len)
        used = jnp.minimum(budget_tokens(spec.budget, mid_len), mid_len)
    else:
        out, lse, used = oracle_sampling_attention(key, q, mk, mv, spec.budget, mid_len)
    B, Hq = q.shape[:2]
    used = jnp.broadcast_to(used[:, None] if used.ndim == 1 else used, (B, Hq)).astype(jnp.int32)
    s_out, s_lse = static_attention(q, k, v, state.start, state.end, lengths, num_sink=spec.magicpig.num_sink)
    out, lse = merge_attention(out, lse, s_out, s_lse)
    return out, lse, used


# ------------------------------------------------------------------------------------------
# MagicPIG in the host op (CPU), optionally sharded over a mesh.
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostOps:
    """The host functions a host backend calls: the plain ops, or their sharded wrappers."""

    build_index: Callable
    attention: Callable  # (q, k, v, index, config, lengths) -> (out, lse, num_sampled)
    append: Callable  # (index, k_new, counts) -> index


def _host_ops() -> HostOps:
    from magicpig_jax import host

    # On one device the op also attends the exact tail [end, length) (window 0): the rows are in
    # the same host memory, and a JAX slice of them costs more than the op.
    attention = functools.partial(host.host_magicpig_attention, static_window=0)
    return HostOps(host.host_build_index, attention, host.host_append)


def sharded(mesh: jax.sharding.Mesh, static_window: int) -> HostOps:
    """The host ops wrapped to run per shard of ``mesh`` (:mod:`magicpig_jax.distributed`)."""
    from magicpig_jax import distributed as dist

    return HostOps(
        build_index=functools.partial(dist.sharded_build_index, mesh),
        attention=functools.partial(dist.sharded_magicpig_attention, mesh, static_window=static_window),
        append=functools.partial(dist.sharded_append, mesh),
    )


def _ops_of(spec: DecodeSpec) -> HostOps:
    return _host_ops() if spec.mesh is None else sharded(spec.mesh, spec.static_window)


def _validate_host(spec: DecodeSpec) -> None:
    from magicpig_jax.host.validate import check_config

    check_config(spec.magicpig)


def _build_host(spec, k, lengths, layer, capacity):
    proj = layer_projections(spec.magicpig, layer, k.shape[-1])
    return _ops_of(spec).build_index(k, proj, spec.magicpig, lengths, capacity=capacity)


def _attend_host(spec, q, k, v, state, lengths, key):
    return _ops_of(spec).attention(q, k, v, state, spec.magicpig, lengths)


def append_due(spec, index, k, lengths):
    """Append the oldest ``generation_buffer`` unhashed keys to a host index when due.

    Due for row b when ``lengths[b] - end[b] >= spec.static_window`` (``lengths`` counts the
    token written this step), so the unhashed tail never exceeds the static window.
    """
    T = spec.generation_buffer
    end = index.end
    due = (lengths - end) >= spec.static_window
    N = k.shape[2]

    def append(index):
        pos = jnp.clip(end[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :], 0, N - 1)
        k_new = jnp.take_along_axis(k, pos[:, None, :, None], axis=2)
        return _ops_of(spec).append(index, k_new, jnp.where(due, T, 0).astype(jnp.int32))

    # Hashing T keys costs T*D*K*L flops: only on the steps where some row is due.
    return jax.lax.cond(jnp.any(due), append, lambda index: index, index)


def _prepare_host(spec, cache, states):
    from magicpig_jax.host import advise_huge_pages

    # The op reads rows of the cache and the index at random: back them with huge pages.
    sparse = spec.sparse_layers(len(cache.k))
    advise_huge_pages([cache.k[i] for i in sparse], [cache.v[i] for i in sparse], [states[i] for i in sparse])
    return cache, states


def _attend_dense_host(q, k, v, lengths):
    from magicpig_jax.host import host_exact_attention

    # One pass over each KV head's keys for its G query heads, K/V read in place.
    return host_exact_attention(q, k, v, lengths)


# ------------------------------------------------------------------------------------------
# MagicPIG as the paper's system on an accelerator: KV cache and index in host memory.
# ------------------------------------------------------------------------------------------


def _build_offload(spec, k, lengths, layer, capacity):
    # Inside the accelerator's jit only the hyperplanes; prepare places the rest.
    return layer_projections(spec.magicpig, layer, k.shape[-1])


def _attend_offload(*args, **kwargs):
    raise ValueError("the offload backend runs its own decode step (make_step), not attend inside jit")


def _prepare_offload(spec, cache, states):
    from magicpig_jax import offload

    return offload.place_decode_state(spec, cache, states)


def _make_offload_step(graphdef, state_treedef, spec):
    from magicpig_jax import offload

    return offload.OffloadDecodeStep(graphdef, state_treedef, spec)


# ------------------------------------------------------------------------------------------
# TopK and Quest in host ops (CPU), and the hybrid estimator (pure JAX).
# ------------------------------------------------------------------------------------------


def _host_range(spec, k, state, lengths):
    """``(start, end)`` of the range a host TopK/Quest attends: ``[num_sink, min(end, lengths))``."""
    s0 = min(spec.magicpig.num_sink, k.shape[2])
    start = jnp.full(lengths.shape, s0, jnp.int32)
    return start, jnp.maximum(jnp.minimum(state.end, lengths), start)


def _static_window_part(spec, q, k, v, start, end, lengths):
    # The tail [end, lengths) never exceeds the static window (the range grows on MagicPIG's schedule).
    return static_attention(q, k, v, start, end, lengths, num_sink=spec.magicpig.num_sink,
                            window=spec.static_window)


def _due(spec, end, lengths):
    return (lengths - end) >= spec.static_window


def _attend_topk_host(spec, q, k, v, state: MiddleRange, lengths, key):
    from magicpig_jax.host.topk import host_topk_attention

    start, end = _host_range(spec, k, state, lengths)
    out, lse = host_topk_attention(q, k, v, spec.budget, end, start=start)
    n = end - start
    used = jnp.broadcast_to(jnp.minimum(budget_tokens(spec.budget, n), n)[:, None], q.shape[:2]).astype(jnp.int32)
    s_out, s_lse = _static_window_part(spec, q, k, v, state.start, state.end, lengths)
    out, lse = merge_attention(out, lse, s_out, s_lse)
    return out, lse, used


def _after_step_range(spec, state: MiddleRange, k, lengths):
    """Move the oldest ``generation_buffer`` unhashed tokens into the range when due (as :func:`append_due`)."""
    due = _due(spec, state.end, lengths)
    return MiddleRange(start=state.start, end=jnp.where(due, state.end + spec.generation_buffer, state.end))


def _build_quest_host(spec, k, lengths, layer, capacity):
    from magicpig_jax.host.quest import quest_build_pages

    start, end = spec.magicpig.hashed_range(lengths)
    s0 = min(spec.magicpig.num_sink, k.shape[2])
    return quest_build_pages(k, jnp.full_like(start, s0), jnp.maximum(end, s0), spec.page_size,
                             capacity=max(capacity - s0, 1))


def _attend_quest_host(spec, q, k, v, state, lengths, key):
    from magicpig_jax.host.quest import host_quest_attention

    out, lse = host_quest_attention(q, k, v, state, spec.budget)
    n = state.end - state.start
    used = jnp.minimum(budget_tokens(spec.budget, n), n)  # as the pure-JAX entry counts it
    used = jnp.broadcast_to(used[:, None], q.shape[:2]).astype(jnp.int32)
    hashed_start = jnp.minimum(jnp.int32(spec.magicpig.num_sink), lengths)
    s_out, s_lse = _static_window_part(spec, q, k, v, hashed_start, state.end, lengths)
    out, lse = merge_attention(out, lse, s_out, s_lse)
    return out, lse, used


def _after_step_quest(spec, state, k, lengths):
    from magicpig_jax.host.quest import quest_append_pages

    T = spec.generation_buffer
    due = _due(spec, state.end, lengths)
    return jax.lax.cond(jnp.any(due), lambda st: quest_append_pages(st, k, jnp.where(due, T, 0), T),
                        lambda st: st, state)


def _validate_hybrid(spec: DecodeSpec) -> None:
    configs = [spec.magicpig] if spec.layers is None else [spec.layers.config(i) for i in spec.layers.sparse_layers]
    for c in configs:
        if not isinstance(c, HybridConfig):
            raise ValueError(f"the 'hybrid' backend needs HybridConfig configurations (with 'heavy'), got {c!r}")


def _attend_hybrid(spec, q, k, v, state: LSHIndex, lengths, key):
    return hybrid_attention(q, k, v, state, spec.magicpig, lengths)


# ------------------------------------------------------------------------------------------
# Per-layer configurations (LayerConfigs): each layer's state carries its own config.
# ------------------------------------------------------------------------------------------


def _check_layers(spec: DecodeSpec) -> None:
    layers = spec.layers
    if not isinstance(layers, LayerConfigs):
        raise TypeError(f"layers must be a LayerConfigs, got {type(layers).__name__}")
    if spec.backend not in LAYERED:
        raise ValueError(f"per-layer configs run with the backends {LAYERED}, got backend={spec.backend!r}")
    if spec.offload or spec.mesh is not None:
        raise ValueError("per-layer configs are not supported with offload or a mesh")
    if tuple(sorted(spec.dense_layers)) != layers.dense_layers:
        raise ValueError(f"dense_layers {tuple(spec.dense_layers)} must be the layer configs' dense layers "
                         f"{layers.dense_layers}")
    if spec.magicpig != layers.base():
        raise ValueError("magicpig must be the layer configs' base() config")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerState:
    """A sparse layer's decode state and its own configuration (static), under :class:`LayerConfigs`."""

    state: Any
    config: MagicPIGConfig = dataclasses.field(metadata=dict(static=True))


@functools.cache
def per_layer(base: Backend) -> Backend:
    """``base`` run with each layer's config of :attr:`DecodeSpec.layers` (states wrapped in :class:`LayerState`)."""

    def build(spec, k, lengths, layer, capacity):
        config = spec.layers.config(layer)
        return LayerState(base.build(spec.with_config(config), k, lengths, layer, capacity), config)

    def attend(spec, q, k, v, state: LayerState, lengths, key):
        return base.attend(spec.with_config(state.config), q, k, v, state.state, lengths, key)

    def after_step(spec, state: LayerState, k, lengths):
        return LayerState(base.after_step(spec.with_config(state.config), state.state, k, lengths), state.config)

    def validate(spec):
        for i in spec.layers.sparse_layers:
            base.validate(spec.with_config(spec.layers.config(i)))

    return dataclasses.replace(base, name=f"{base.name}, per-layer configs", build=build, attend=attend,
                               after_step=after_step, validate=validate)


# ------------------------------------------------------------------------------------------
# The table.
# ------------------------------------------------------------------------------------------

_TABLE: dict[str, Backend] = {
    "dense": Backend("dense", build=_no_sparse_layer, attend=_no_sparse_layer),
    "magicpig-ref": Backend("magicpig-ref", build=_build_reference, attend=_attend_reference),
    "topk": Backend("topk", build=_build_range, attend=functools.partial(_attend_range, "topk")),
    "quest": Backend("quest", build=_build_range, attend=functools.partial(_attend_range, "quest")),
    "oracle": Backend("oracle", build=_build_range, attend=functools.partial(_attend_range, "oracle")),
    "magicpig-host": Backend("magicpig (host op)", build=_build_host, attend=_attend_host,
                             after_step=append_due, prepare=_prepare_host, attend_dense=_attend_dense_host,
                             validate=_validate_host),
    "magicpig-host-sharded": Backend("magicpig (host op, sharded)", build=_build_host, attend=_attend_host,
                                     after_step=append_due, prepare=_prepare_host, validate=_validate_host),
    "magicpig-offload": Backend("magicpig (offload: KV cache and index in host memory, host op)",
                                build=_build_offload, attend=_attend_offload, prepare=_prepare_offload,
                                validate=_validate_host, make_step=_make_offload_step),
    "topk-host": Backend("topk (host op)", build=_build_range, attend=_attend_topk_host,
                         after_step=_after_step_range, prepare=_prepare_host, attend_dense=_attend_dense_host),
    "quest-host": Backend("quest (host op)", build=_build_quest_host, attend=_attend_quest_host,
                          after_step=_after_step_quest, prepare=_prepare_host, attend_dense=_attend_dense_host),
    "hybrid": Backend("hybrid (pure JAX)", build=_build_reference, attend=_attend_hybrid,
                      validate=_validate_hybrid),
}


def backend_for(spec: DecodeSpec) -> Backend:
    """The :class:`Backend` that runs ``spec``: the one place the decoder dispatches on the method."""
    if spec.layers is not None:
        return per_layer(_entry(spec))
    return _entry(spec)


def _entry(spec: DecodeSpec) -> Backend:
    if spec.backend == "magicpig":
        if spec.offload:
            return _TABLE["magicpig-offload"]
        if spec.uses_host:
            return _TABLE["magicpig-host" if spec.mesh is None else "magicpig-host-sharded"]
        return _TABLE["magicpig-ref"]
    if spec.backend in ("topk", "quest") and spec.uses_host and spec.mesh is None:
        return _TABLE[f"{spec.backend}-host"]
    return _TABLE[spec.backend]
