"""The decode spec, the hashed range of the baselines, and the :class:`Backend` record.

See :mod:`magicpig_jax.models.backends` for the table and what each part of a backend does.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from magicpig_jax import lsh
from magicpig_jax.attention import (
    GENERATION_BUFFER,
    MagicPIGConfig,
    dense_attention,
)
from magicpig_jax.attention._common import int32_clipped
from magicpig_jax.attention.baselines import Budget, check_budget, check_page_size
from magicpig_jax.attention.layer_configs import LayerConfigs

__all__ = ["BACKENDS", "BUDGETED", "HOST_BACKENDS", "LAYERED", "Backend", "DecodeSpec", "MiddleRange",
           "SharedProjections", "drop_projections", "host_ops_by_default", "layer_projections", "projection_sources",
           "resolve_projections", "with_shared_projections"]

BACKENDS = ("dense", "magicpig", "magicpig-ref", "topk", "quest", "oracle", "hybrid")
BUDGETED = ("topk", "quest", "oracle")
HOST_BACKENDS = ("dense", "magicpig", "topk", "quest")  # the backends with a host op (CPU backend)
LAYERED = ("magicpig", "magicpig-ref", "hybrid")  # the backends that take per-layer LayerConfigs


def host_ops_by_default() -> bool:
    """Whether the host ops run the ``HOST_BACKENDS`` by default: on JAX's CPU backend. On a GPU or
    TPU backend ``magicpig`` offloads (one config for every layer) or runs in pure JAX (per-layer
    configs), and the other backends run in pure JAX (:class:`DecodeSpec`'s ``host`` and ``offload``)."""
    return jax.default_backend() == "cpu"


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
        them are appended to the index in one call; in ``[1, 2**29]``.
      host: whether "magicpig" runs through the host op on the CPU backend (default: iff
        JAX's default backend is the CPU; left None on an offload spec, whose decoder always runs
        the host op); ``False`` runs it in pure JAX on any backend (and so turns the offload
        default off; with ``offload=True`` it is an error).
      mesh: optional ``("batch", "kv_heads")`` mesh for the host op (None: one device).
      offload: whether "magicpig" runs as the host-offload system (:mod:`magicpig_jax.offload`):
        the sparse layers' KV cache and index on ``host_device``, the rest on the accelerator
        (JAX's default device). Default: iff JAX's default backend is not the CPU, and neither a
        mesh, per-layer configs nor ``host=False`` is given.
      host_device: the CPU device that holds the offloaded cache and runs the host op
        (default ``jax.devices("cpu")[0]``; the tests pass a second virtual CPU device so that
        two CPU devices stand in for the accelerator and the host).
      layers: optional :class:`~magicpig_jax.attention.LayerConfigs` (``magicpig``,
        ``magicpig-ref``, ``hybrid``): each layer's own config or ``"dense"``; then ``magicpig``
        must be ``layers.base()`` and ``dense_layers`` its dense layers.
      logit_softcap: the model's attention logit soft-capping c (Gemma 2's
        ``attn_logit_softcapping``: each logit s becomes ``c * tanh(s / c)``), or None. The
        decode step sets it from the model's config (:meth:`with_softcap`); every backend applies
        it to the logits of its softmax (the selections of TopK and Quest, and the hashing, rank
        or compare the uncapped scores, which the monotone cap orders the same way).

    Raises:
      TypeError: ``host`` or ``offload`` not a bool or None, ``host_device`` not a ``jax.Device``,
        ``generation_buffer`` not an int.
      ValueError: unknown backend, a budgeted backend without a budget, a configuration
        the chosen backend cannot run (e.g. K > 16 on the host op), ``host_device``
        without the offload decoder (it would be ignored), or ``host=False`` with ``offload=True``.
    """

    backend: str = "dense"
    magicpig: MagicPIGConfig = MagicPIGConfig()
    dense_layers: tuple[int, ...] = ()
    budget: Budget | None = None
    page_size: int = 16
    generation_buffer: int = GENERATION_BUFFER
    host: bool | None = None
    mesh: jax.sharding.Mesh | None = None
    offload: bool | None = None
    host_device: jax.Device | None = None
    layers: LayerConfigs | None = None
    logit_softcap: float | None = None
    # The budget's kind, compared and hashed with it: 1 (one token) and 1.0 (every key) are equal
    # Python numbers with one hash, so without it two specs differing only there would share a
    # compiled decode step (jit's static argument), and the second would silently run the first.
    budget_kind: str | None = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"attention backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend in BUDGETED:
            if self.budget is None:
                raise ValueError(f"attention backend {self.backend!r} needs a budget (tokens or a fraction)")
            check_budget(self.budget)
            if isinstance(self.budget, np.integer | np.floating):  # stored as Python: hashable alike, JSON-able
                object.__setattr__(self, "budget", self.budget.item())
            object.__setattr__(self, "budget_kind", "tokens" if isinstance(self.budget, int) else "fraction")
            check_page_size(self.page_size)
        elif self.budget is not None:
            raise ValueError(f"budget applies to the {', '.join(BUDGETED)} backends only, got backend={self.backend!r}")
        if isinstance(self.generation_buffer, bool | np.bool_) or not isinstance(self.generation_buffer,
                                                                                 int | np.integer):
            raise TypeError(f"generation_buffer must be an int, got {self.generation_buffer!r}")
        object.__setattr__(self, "generation_buffer", int(self.generation_buffer))  # hashed as a Python int
        if not 1 <= self.generation_buffer <= 2**29:
            raise ValueError(f"generation_buffer must be in [1, 2**29] (the static window, num_local plus two "
                             f"buffers, is an int32 position), got {self.generation_buffer}")
        if self.backend != "hybrid":
            configs = [self.magicpig, *(c for _, c in (self.layers.layers if self.layers is not None else ()))]
            if any(getattr(c, "heavy", None) is not None for c in configs):
                raise ValueError(f"a heavy threshold (HybridConfig) is the 'hybrid' backend's; backend "
                                 f"{self.backend!r} would ignore it")
        if self.layers is not None:
            from magicpig_jax.models.backends.table import check_layers

            check_layers(self)
        for name in ("host", "offload"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool | np.bool_):
                raise TypeError(f"{name} must be a bool or None (the default), got {value!r}")
            if value is not None:
                object.__setattr__(self, name, bool(value))
        if self.host_device is not None and not isinstance(self.host_device, jax.Device):
            raise TypeError(f"host_device must be a jax.Device (e.g. jax.devices('cpu')[0]), got {self.host_device!r}")
        if self.host is False and self.offload:
            raise ValueError("host=False runs MagicPIG in pure JAX, and the offload decoder (offload=True) runs "
                             "the host op: drop one of host=False and offload=True")
        if self.offload is None:
            object.__setattr__(self, "offload", self.backend == "magicpig" and self.mesh is None
                               and self.layers is None and self.host is not False and not host_ops_by_default())
        if self.offload and (self.backend != "magicpig" or self.mesh is not None):
            raise ValueError("offload runs the 'magicpig' backend on one accelerator (no mesh), "
                             f"got backend={self.backend!r}, mesh={self.mesh}")
        if self.host_device is not None and self.host_device.platform != "cpu":
            raise ValueError(f"host_device must be a CPU device, got {self.host_device}")
        if self.host_device is not None and not self.offload:
            raise ValueError(f"host_device applies to the offload decoder only (offload=True), which this spec does "
                             f"not run (backend={self.backend!r}, offload={self.offload}); drop host_device or "
                             "pass offload=True")
        # Resolved only where it decides something: the offload decoder always runs the host op, so an
        # offload spec keeps host None, and a replace() of it (offload=False, a softcap) resolves afresh.
        if self.host is None and not self.offload:
            object.__setattr__(self, "host", self.backend in HOST_BACKENDS and host_ops_by_default())
        from magicpig_jax.attention._common import check_softcap
        from magicpig_jax.models.backends.table import backend_for

        object.__setattr__(self, "logit_softcap", check_softcap(self.logit_softcap))
        entry = backend_for(self)
        entry.validate(self)

    def with_softcap(self, softcap: float | None) -> DecodeSpec:
        """This spec for a model whose attention logit soft-capping is ``softcap`` (its config's
        ``attn_logit_softcap``); raises ValueError for a cap outside the allowed range."""
        if softcap == self.logit_softcap:
            return self
        return dataclasses.replace(self, logit_softcap=softcap)

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
        """The range of :meth:`MagicPIGConfig.hashed_range` for a decoder: see :func:`decode_range_lengths`."""
        start, end = config.hashed_range(decode_range_lengths(lengths, config.num_sink))
        return cls(start=start, end=end)


def decode_range_lengths(lengths: jax.Array, num_sink: int, capacity: int | None = None) -> jax.Array:
    """The lengths a decoder builds its hashed range (or index) from: ``max(lengths, num_sink)``.

    A prompt shorter than ``num_sink`` would give the range ``[length, length)``, from which later
    appends would hash (or, for TopK, rank) the generated tokens at positions ``[length,
    num_sink)``: sinks by definition (the first ``num_sink`` tokens of the context). From these
    lengths the range is ``[num_sink, num_sink)``, empty, and ``end`` stays past the context until
    it grows there; every decode path clips the sinks ``[0, start)`` to the context.

    Args:
      lengths: int ``[B]`` the prompts' lengths.
      num_sink: sink tokens.
      capacity: the cache's positions, which bounds the ``num_sink`` floor (a length past it stays
        as it is; default: no bound).

    Returns:
      int32 ``[B]``.

    Raises:
      TypeError: ``lengths`` not an integer array.
    """
    bound = num_sink if capacity is None else min(num_sink, capacity)
    return jnp.maximum(int32_clipped(lengths), jnp.int32(bound))


def layer_projections(config: MagicPIGConfig, layer: int | jax.Array, head_dim: int) -> jax.Array:
    """SimHash projections of one layer, float32 ``[D, K*L]``.

    ``simhash_projections(fold_in(key(seed), layer // layers_per_projection), D, K, L)``: with
    the default ``layers_per_projection = 1`` every layer has its own matrix; layers of one group
    with equal configs get equal matrices (:attr:`MagicPIGConfig.layers_per_projection`).

    Args:
      config: the layer's :class:`MagicPIGConfig` (K, L, seed, layers_per_projection).
      layer: the layer's index in the model (an ``int`` or a traced int32 scalar).
      head_dim: D.

    Raises:
      ValueError / TypeError: an invalid ``head_dim`` (from :func:`magicpig_jax.lsh.simhash_projections`).

    Source: arXiv 2410.16179, Section 4.2 (Gaussian SimHash hyperplanes); the grouping follows the
    MagicPIG reference implementation (one matrix per 16 layers in its ``models/cache.py``).
    """
    group = layer // config.layers_per_projection if config.layers_per_projection > 1 else layer
    key = jax.random.fold_in(jax.random.key(config.seed), group)
    return lsh.simhash_projections(key, head_dim, config.K, config.L)


def projection_sources(spec: DecodeSpec, num_layers: int) -> dict[int, int]:
    """Sparse layers whose projections equal an earlier sparse layer's: ``{layer: source layer}``.

    Layer ``i`` maps to the first sparse layer ``j < i`` with the same configuration (hence the
    same K, L, seed and ``layers_per_projection``) in the same group
    (``i // layers_per_projection == j // layers_per_projection``): :func:`layer_projections`
    gives them equal matrices. The decode step hashes layer ``i``'s queries with layer ``j``'s
    buffer (:func:`with_shared_projections`), so one matrix serves the group and stays in the
    CPU caches across the step's layers. Empty when ``layers_per_projection`` is 1.

    Source: the MagicPIG reference implementation hashes every layer of a group of 16 with one
    matrix (``hash_matrix[layer_idx // 16]`` in its ``models/cache.py``).
    """
    sparse = spec.sparse_layers(num_layers)
    first: dict[tuple, int] = {}
    out: dict[int, int] = {}
    for i in sparse:
        config = spec.layers.config(i) if spec.layers is not None else spec.magicpig
        n = config.layers_per_projection
        if n <= 1:
            continue
        j = first.setdefault((i // n, config), i)
        if j != i:
            out[i] = j
    return out


def _has_own(state: Any) -> bool:
    return hasattr(state, "projections") and state.projections.shape[1] > 0


def with_shared_projections(state: Any, source: Any) -> Any:
    """``state`` with the projections of ``source`` (same layout; see :func:`projection_sources`).

    States without projections (the hashed range of TopK/Quest) are returned unchanged; a
    per-layer :class:`~magicpig_jax.models.backends.table.LayerState` is unwrapped.

    Args:
      state, source: two sparse layers' decode states (e.g. :class:`~magicpig_jax.host.HostIndex`,
        projections float32 ``[D, K*L]``), traced or concrete; ``state``'s own projections may have
        been dropped (:func:`drop_projections`).

    Raises:
      ValueError: ``source`` holds no projections of its own, or the two differ in shape.

    Returns:
      ``state`` (same type) whose projections are ``source``'s buffer; the caller guarantees that
      their values are equal (:func:`projection_sources`: one spec builds both).
    """
    inner, src = getattr(state, "state", None), getattr(source, "state", None)
    if inner is not None and src is not None and hasattr(state, "config"):
        return dataclasses.replace(state, state=with_shared_projections(inner, src))
    if not (hasattr(state, "projections") and hasattr(source, "projections")):
        return state
    if not _has_own(source):
        raise ValueError("the source layer's state holds no projections of its own (dropped by drop_projections)")
    if state.projections.shape[0] != source.projections.shape[0] or (
            _has_own(state) and tuple(state.projections.shape) != tuple(source.projections.shape)):
        raise ValueError(f"shared projections must have one shape, got {tuple(state.projections.shape)} "
                         f"and {tuple(source.projections.shape)}")
    return dataclasses.replace(state, projections=source.projections)


def drop_projections(state: Any) -> Any:
    """``state`` with its projections replaced by an empty float32 ``[D, 0]`` array.

    A layer of a group keeps no copy of the group's matrix (:class:`SharedProjections`); the
    empty array keeps ``D`` in the shape for the checks of :func:`with_shared_projections`.
    States without projections are returned unchanged; a ``LayerState`` is unwrapped.
    """
    inner = getattr(state, "state", None)
    if inner is not None and hasattr(state, "config"):
        return dataclasses.replace(state, state=drop_projections(inner))
    if not hasattr(state, "projections"):
        return state
    return dataclasses.replace(state, projections=jnp.zeros((state.projections.shape[0], 0), jnp.float32))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["state"], meta_fields=["source"])
@dataclasses.dataclass
class SharedProjections:
    """A sparse layer's decode state whose SimHash matrix is held by layer ``source``'s state.

    :func:`~magicpig_jax.models.decoding.build_indices` stores this for every layer of
    :func:`projection_sources`: the layer's own ``[D, K*L]`` copy is dropped
    (:func:`drop_projections`), so a group holds one matrix, and the decode step hashes the
    layer's queries and appended keys with the source's (:func:`resolve_projections`). The
    source is recorded at build time, so a decode whose spec groups the layers differently
    still hashes each layer with the matrix its keys were hashed with.

    Attributes:
      state: the layer's state without its projections.
      source: the layer whose state holds the matrix (static).
    """

    state: Any
    source: int


def resolve_projections(indices: tuple | list, layer: int) -> Any:
    """Layer ``layer``'s decode state with its SimHash matrix in place.

    A :class:`SharedProjections` gets its source layer's projections
    (:func:`with_shared_projections`); any other state is returned as is.

    Raises:
      ValueError: the source layer's state is itself shared or holds no projections (indices not
        built by :func:`~magicpig_jax.models.decoding.build_indices`).
    """
    state = indices[layer]
    if not isinstance(state, SharedProjections):
        return state
    source = indices[state.source]
    if isinstance(source, SharedProjections) or source is None:
        raise ValueError(f"layer {layer} shares the projections of layer {state.source}, whose state does not "
                         "hold them")
    return with_shared_projections(state.state, source)


# The signatures of a backend's parts (q [B, Hq, D], k/v [B, Hkv, N, D], lengths int32 [B]).
BuildFn = Callable[["DecodeSpec", jax.Array, jax.Array, int, int], Any]  # (spec, k, lengths, layer, capacity)
AttendFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]  # (spec, q, k, v, state, lengths, key)
AfterStepFn = Callable[["DecodeSpec", Any, jax.Array, jax.Array], Any]  # (spec, state, k, lengths)
PrepareFn = Callable[..., tuple[Any, tuple]]  # (spec, cache, states) -> (cache, states)
DenseFn = Callable[..., tuple[jax.Array, jax.Array]]  # (q, k, v, lengths, starts=None, *, softcap=None)


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
      attend_dense: ``(q, k, v, lengths, starts=None, *, softcap=None) -> (out, lse)`` for the
        layers kept dense (``starts``: a sliding-window layer's first visible key per row;
        ``softcap``: the spec's :attr:`DecodeSpec.logit_softcap`).
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


