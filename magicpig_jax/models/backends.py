"""Decode attention backends of the Llama decoder: one table, one entry per method.

Every sparse backend keeps the static set exact — the first ``num_sink`` tokens, the last
``num_local`` prompt tokens and the generated tokens not yet in the sampled set — and applies
its method to the hashed range ``[start, end)`` of :meth:`MagicPIGConfig.hashed_range`, so the
methods are compared like for like (arXiv 2410.16179, Section 5).

Each :class:`Backend` has four parts, called by the decoder in this order:

  build       (inside jit, after prefill) the per-layer decode state of a sparse layer;
  prepare     (outside jit, once) place that state in memory (huge pages for the host op);
  attend      (inside the decode step) ``(out, lse, keys_used)`` of a sparse layer;
  after_step  (inside the decode step, after the cache write) update the state
              (the host index appends generated tokens when a generation buffer is due).

``attend_dense`` is the exact attention of the layers kept dense under the backend.
:func:`backend_for` is the one place that chooses the entry for a :class:`DecodeSpec`:

  dense         exact attention over every cached key (no sparse layer).
  magicpig      LSH sampling; on the CPU backend the index and the sampled attention run in
                the host op (:mod:`magicpig_jax.host`), elsewhere the pure-JAX reference.
  magicpig-ref  LSH sampling, pure-JAX reference (:func:`magicpig_attention`).
  topk          exact TopK of the hashed range (``budget`` keys).
  quest         Quest page selection in the hashed range (``budget`` keys, ``page_size`` pages).
  oracle        oracle sampling (Def. 3.1) of ``budget`` draws from the hashed range.

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

__all__ = ["BACKENDS", "BUDGETED", "Backend", "DecodeSpec", "MiddleRange", "backend_for", "layer_projections"]

BACKENDS = ("dense", "magicpig", "magicpig-ref", "topk", "quest", "oracle")
BUDGETED = ("topk", "quest", "oracle")


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
      host: whether "magicpig" runs through the host op (default: iff JAX's default
        backend is the CPU).
      mesh: optional ``("batch", "kv_heads")`` mesh for the host op (None: one device).

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
        if self.host is None:
            object.__setattr__(self, "host", self.backend == "magicpig" and jax.default_backend() == "cpu")
        backend_for(self).validate(self)

    @property
    def uses_host(self) -> bool:
        """True when the sparse layers run through the host op."""
        return bool(self.host) and self.backend == "magicpig"

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
PrepareFn = Callable[["DecodeSpec", list, list, list], None]  # (spec, k layers, v layers, states)
DenseFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def _keep(spec, state, k, lengths):
    return state


def _nothing(spec, k_layers, v_layers, states) -> None:
    return None


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
      prepare: ``(spec, k_layers, v_layers, states) -> None`` once after build, outside jit.
      attend_dense: ``(q, k, v, lengths) -> (out, lse)`` for the layers kept dense.
      validate: ``(spec) -> None``, raises ValueError for a configuration it cannot run.
    """

    name: str
    build: BuildFn
    attend: AttendFn
    after_step: AfterStepFn = _keep
    prepare: PrepareFn = _nothing
    attend_dense: DenseFn = dense_attention
    validate: Callable[[DecodeSpec], None] = _accept


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


def _append_due(spec, index, k, lengths):
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


def _prepare_host(spec, k_layers, v_layers, states) -> None:
    from magicpig_jax.host import advise_huge_pages

    # The op reads rows of the cache and the index at random: back them with huge pages.
    advise_huge_pages(k_layers, v_layers, states)


def _attend_dense_host(q, k, v, lengths):
    from magicpig_jax.host import host_exact_attention

    # One pass over each KV head's keys for its G query heads, K/V read in place.
    return host_exact_attention(q, k, v, lengths)


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
                             after_step=_append_due, prepare=_prepare_host, attend_dense=_attend_dense_host,
                             validate=_validate_host),
    "magicpig-host-sharded": Backend("magicpig (host op, sharded)", build=_build_host, attend=_attend_host,
                                     after_step=_append_due, prepare=_prepare_host, validate=_validate_host),
}


def backend_for(spec: DecodeSpec) -> Backend:
    """The :class:`Backend` that runs ``spec``: the one place the decoder dispatches on the method."""
    if spec.backend == "magicpig":
        if spec.uses_host:
            return _TABLE["magicpig-host" if spec.mesh is None else "magicpig-host-sharded"]
        return _TABLE["magicpig-ref"]
    return _TABLE[spec.backend]
