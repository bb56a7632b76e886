"""The accelerator offload path of MagicPIG: KV cache and hash tables in host memory.

MagicPIG's system split (arXiv 2410.16179, Section 4.3): the projections, the query's
SimHash codes and the small static set (sinks, local window, generated tokens) stay on
the accelerator; the KV cache and the LSH index, which do not fit there at long
contexts, live in host memory as arrays on a CPU device, where the host op
(:mod:`magicpig_jax.host`, an XLA FFI custom call for the CPU platform) samples and
attends. Per layer and decode step:

1. accelerator: ``codes = simhash(q)``, static attention ``(out_s, lse_s)``;
2. ``q`` and ``codes`` go to the host device (``jax.device_put``: B x Hq x (D + L) x 4 bytes);
3. host: the sampled attention over the hashed range ``(out_h, lse_h, num_sampled)``;
4. ``(out_h, lse_h)`` come back and are merged with ``(out_s, lse_s)`` on the
   accelerator through their log-sum-exp (:func:`magicpig_jax.attention.merge_attention`).

Each part is a jitted function whose inputs are committed to one device, so it runs
there; the transfers between them are explicit ``device_put`` calls outside ``jit``.
Only the query, its codes and two small results cross: the keys never move. The result
equals :func:`magicpig_jax.host.host_magicpig_attention` and, to float32 rounding,
:func:`magicpig_jax.attention.magicpig_attention`.

Usage for one layer (``accel = jax.devices("gpu")[0]``, ``cpu = jax.devices("cpu")[0]``)::

    index = host_build_index(k_cpu, proj, config, lengths, capacity=N)       # on the host
    accel_state, host_state = prepare_offload(k_cpu, v_cpu, index, config, lengths,
                                              accel_device=accel, host_device=cpu)
    out, lse, num_sampled = offload_magicpig_attention(q, accel_state, host_state, config)

``examples/accelerator_check.py`` runs this on a GPU (or CPU-only) machine and prints the
error against dense attention and the time per step; the test suite runs the same code
with two virtual CPU devices standing in for the accelerator and the host.

The decoder uses the same split for every sparse layer
(:mod:`magicpig_jax.offload_decoder`; the ``"magicpig-offload"`` entry of
:mod:`magicpig_jax.models.backends`, chosen for ``attention="magicpig"`` on a GPU/TPU
backend): the layer's KV cache and index stay on the host device for the whole decode, the
accelerator keeps the hyperplanes, the sinks and a ring of the last W positions, and each
step runs as jitted accelerator segments (from one sparse layer to the next) alternating
with one host computation per sparse layer. Its GPU runs are in docs/benchmarks.md ("On a GPU").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from magicpig_jax import host, lsh
from magicpig_jax.attention.config import MagicPIGConfig
from magicpig_jax.attention.dense import dense_attention
from magicpig_jax.attention.merge import merge_attention
from magicpig_jax.host.validate import check_config, check_index, check_int, check_lengths_strict

__all__ = [
    "StaticKV",
    "AccelState",
    "HostState",
    "static_kv",
    "prepare_offload",
    "offload_magicpig_attention",
    "accelerator_part",
    "host_part",
    "merge_part",
    "default_devices",
]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["sink_k", "sink_v", "sink_len", "tail_k", "tail_v", "tail_len"], meta_fields=[])
@dataclasses.dataclass
class StaticKV:
    """The static (exactly attended) keys of one layer, kept on the accelerator.

    Attributes:
      sink_k, sink_v: ``[B, Hkv, S, D]`` the first ``S = num_sink`` positions; row b's
        first ``sink_len[b]`` are valid.
      sink_len: int32 ``[B]`` = ``min(start, lengths)``.
      tail_k, tail_v: ``[B, Hkv, W, D]`` the last ``W`` positions, newest first; row b's
        first ``tail_len[b]`` are valid (those at or after the index's ``end``).
      tail_len: int32 ``[B]`` = ``max(lengths - max(end, lengths - W), 0)``.
    """

    sink_k: Float[Array, "B Hkv S D"]
    sink_v: Float[Array, "B Hkv S D"]
    sink_len: Int[Array, " B"]
    tail_k: Float[Array, "B Hkv W D"]
    tail_v: Float[Array, "B Hkv W D"]
    tail_len: Int[Array, " B"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["projections", "static"], meta_fields=[])
@dataclasses.dataclass
class AccelState:
    """What a layer keeps on the accelerator: the SimHash hyperplanes and the static set."""

    projections: Float[Array, "D KL"]
    static: StaticKV


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "index", "lengths"],
                   meta_fields=["window", "placed"])
@dataclasses.dataclass
class HostState:
    """What a layer keeps in host memory: the KV cache, its index, the row lengths.

    ``window``: the tail positions attended on the accelerator (static); the host op
    attends exactly the unhashed keys of ``[end, lengths - window)`` besides the sampled ones.
    ``placed``: the ``(K, L, num_sink, num_local)`` of the configuration :func:`prepare_offload`
    was given (static); :func:`offload_magicpig_attention` refuses a configuration with others.
    None for a state built by hand (then nothing is checked).
    """

    k: Float[Array, "B Hkv N D"]
    v: Float[Array, "B Hkv N D"]
    index: host.HostIndex
    lengths: Int[Array, " B"]
    window: int
    placed: tuple[int, int, int, int] | None = None


# The fields of a configuration that a prepared offload state fixes (its tables, its static set).
PLACED_FIELDS = ("K", "L", "num_sink", "num_local")


def default_devices() -> tuple[jax.Device, jax.Device]:
    """``(accelerator, host)``: JAX's first default device and the first CPU device (the same
    device on a CPU-only machine)."""
    return jax.devices()[0], jax.devices("cpu")[0]


@functools.partial(jax.jit, static_argnames=("num_sink", "window"))
def static_kv(k, v, start, end, lengths, *, num_sink: int, window: int) -> StaticKV:
    """Gather the static set of a layer: sinks ``[0, start)`` and tail ``[max(end, len - W), len)``.

    The same split as :func:`magicpig_jax.host.host_magicpig_attention` (``W`` = its
    ``static_window``). Runs where ``k``/``v`` live; ``device_put`` the result to the
    accelerator.

    Args:
      k, v: float ``[B, Hkv, N, D]``, the layer's cache.
      start, end: int32 ``[B]``, each row's hashed range ``[start, end)`` (the index's).
      lengths: int32 ``[B]``, each row's valid keys.
      num_sink: static, the sink tokens ``S`` kept exactly.
      window: static, the tail positions ``W`` kept exactly.

    Returns:
      a :class:`StaticKV`: the sinks ``[B, Hkv, S, D]`` and the tail ``[B, Hkv, W, D]`` in ``k``'s
      dtype, with their valid counts int32 ``[B]``.
    """
    B, _, N, _ = k.shape
    ns = min(num_sink, N)
    W = min(window, N)
    idx = jnp.clip(lengths[:, None] - 1 - jnp.arange(W, dtype=jnp.int32)[None, :], 0, N - 1)
    return StaticKV(
        sink_k=k[:, :, :ns], sink_v=v[:, :, :ns], sink_len=jnp.minimum(start, lengths).astype(jnp.int32),
        tail_k=jnp.take_along_axis(k, idx[:, None, :, None], axis=2),
        tail_v=jnp.take_along_axis(v, idx[:, None, :, None], axis=2),
        tail_len=jnp.maximum(lengths - jnp.maximum(end, lengths - W), 0).astype(jnp.int32),
    )


def prepare_offload(
    k: jax.Array,
    v: jax.Array,
    index: host.HostIndex,
    config: MagicPIGConfig,
    lengths: jax.Array | None = None,
    *,
    accel_device: jax.Device,
    host_device: jax.Device,
    static_window: int | None = None,
) -> tuple[AccelState, HostState]:
    """Place one layer's state: cache and index on ``host_device``, hyperplanes and static set on
    ``accel_device``.

    Args:
      k, v: ``[B, Hkv, N, D]`` float32 or bfloat16, the layer's cache (anywhere; moved to the host).
      index: its :class:`~magicpig_jax.host.HostIndex` (from ``host_build_index``).
      config: the :class:`MagicPIGConfig` of the index.
      lengths: int ``[B]`` valid keys per row (default N).
      accel_device, host_device: the two devices (``host_device`` must be a CPU device).
      static_window: tail positions attended exactly on the accelerator (default
        :meth:`MagicPIGConfig.static_window`, as ``host_magicpig_attention``).

    Returns:
      ``(AccelState on accel_device, HostState on host_device)``.

    Raises:
      ValueError: ``host_device`` is not a CPU device, or bad shapes / config (``v`` not of ``k``'s
        shape).
      TypeError: a device that is not a ``jax.Device``; ``k`` or ``v`` not an array, or of different
        dtypes; a config, index or lengths of the wrong type or dtype (named).
    """
    for name, dev in (("accel_device", accel_device), ("host_device", host_device)):
        if not isinstance(dev, jax.Device):
            raise TypeError(f"{name} must be a jax.Device (e.g. jax.devices('cpu')[0]), got {dev!r}")
    if host_device.platform != "cpu":
        raise ValueError(f"host_device must be a CPU device (the host op runs on the CPU platform), "
                         f"got {host_device}")
    check_config(config)
    for name, x in (("k", k), ("v", v)):
        if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be a JAX or NumPy array [B, Hkv, N, D], got {type(x).__name__}")
    if k.ndim != 4:
        raise ValueError(f"k must be [B, Hkv, N, D], got shape {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if v.dtype != k.dtype:
        raise TypeError(f"v must have k's dtype {k.dtype}, got {v.dtype}")
    B, Hkv, N, D = k.shape
    check_index(index, config, B, Hkv, D)
    if static_window is None:
        static_window = config.static_window()
    static_window = check_int("static_window", static_window, 0, 2**31 - 1)
    lengths = check_lengths_strict(lengths, B, N)
    k, v, index, lengths = jax.device_put((k, v, index, lengths), host_device)
    static = static_kv(k, v, index.start, index.end, lengths, num_sink=config.num_sink, window=static_window)
    # a copy: with accel_device == host_device, device_put keeps the buffer, and donating the index
    # (host_append) would delete the accelerator's hyperplanes with it
    accel = AccelState(projections=jnp.array(index.projections, copy=True), static=static)
    return jax.device_put(accel, accel_device), HostState(k=k, v=v, index=index, lengths=lengths,
                                                          window=static_window,
                                                          placed=tuple(getattr(config, f) for f in PLACED_FIELDS))


@functools.partial(jax.jit, static_argnames=("K", "L"))
def accelerator_part(q, state: AccelState, *, K: int, L: int):
    """On the accelerator: the query's codes (uint32 ``[B, Hq, L]``) and the static attention
    ``(out_s, lse_s)`` over the sinks and the tail."""
    codes = lsh.simhash_codes(q, state.projections, K, L)
    s = state.static
    o_a, l_a = dense_attention(q, s.sink_k, s.sink_v, s.sink_len)
    o_b, l_b = dense_attention(q, s.tail_k, s.tail_v, s.tail_len)
    out, lse = merge_attention(o_a, l_a, o_b, l_b)
    return codes, out, lse


@functools.partial(jax.jit, static_argnames=("impl", "max_threads"))
def host_part(q, codes, state: HostState, *, impl: str = "auto", max_threads: int = 0):
    """On the host CPU device: the host op's sampled attention ``(out_h, lse_h, num_sampled)``."""
    return host.host_sampled_attention(q, codes, state.k, state.v, state.index, state.lengths,
                                       window=state.window, impl=impl, max_threads=max_threads)


@jax.jit
def merge_part(out_h, lse_h, out_s, lse_s):
    """On the accelerator: the exact LSE merge of the host and static parts."""
    return merge_attention(out_h, lse_h, out_s, lse_s)


def offload_magicpig_attention(
    q: jax.Array,
    accel_state: AccelState,
    host_state: HostState,
    config: MagicPIGConfig,
    *,
    impl: str = "auto",
    max_threads: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's MagicPIG decode attention with the cache and index in host memory.

    Args:
      q: float ``[B, Hq, D]`` on the accelerator (the layer's query; moved there if not).
      accel_state, host_state: from :func:`prepare_offload`.
      config: a :class:`MagicPIGConfig` with the K, L, ``num_sink`` and ``num_local`` given to
        :func:`prepare_offload` (its K and L hash the query; the static set was placed there). One
        with others is refused: such a field (e.g. ``num_local``) could not take effect here. Its
        seed and ``layers_per_projection`` are not read (the hyperplanes are the index's).
      impl, max_threads: the host op's kernel choice and thread cap.

    Returns:
      ``(out float32 [B, Hq, D], lse float32 [B, Hq])`` on the accelerator and
      ``num_sampled int32 [B, Hq]`` on the host device; equal to
      ``host_magicpig_attention(q, k, v, index, config, lengths, static_window=window)``.

    Raises:
      TypeError, ValueError: as :func:`magicpig_jax.lsh.simhash_codes` and
        :func:`magicpig_jax.host.host_sampled_attention`: ``q`` of another shape than the layer's,
        a ``config`` whose K or L is not the index's (its query codes do not fit the tables), or
        a ``config`` whose K, L or static set is not the one :func:`prepare_offload` was given
        (the fields named).
      ImportError: the native extension is not built.

    Source: arXiv 2410.16179, Section 4.3 (the CPU-GPU system); docs/design.md, "Sharding and
    accelerator offload".
    """
    check_config(config)
    B, Hkv, _, D = host_state.k.shape
    if not hasattr(q, "ndim") or q.ndim != 3 or q.shape[0] != B or q.shape[2] != D or Hkv < 1 or q.shape[1] % Hkv:
        raise ValueError(f"q must be [B, Hq, D] with the layer's B = {B}, D = {D} and Hq a multiple of Hkv = {Hkv}, "
                         f"got {tuple(getattr(q, 'shape', ()))}")
    placed = host_state.placed
    if placed is not None:
        diff = ", ".join(f"{name}={getattr(config, name)} (prepared with {was})"
                         for name, was in zip(PLACED_FIELDS, placed, strict=True) if getattr(config, name) != was)
        if diff:
            raise ValueError(f"config must have the K, L and static set given to prepare_offload: {diff}")
    accel = next(iter(accel_state.projections.devices()))
    host_dev = next(iter(host_state.k.devices()))
    q = jax.device_put(q, accel)
    codes, out_s, lse_s = accelerator_part(q, accel_state, K=config.K, L=config.L)
    q_h, codes_h = jax.device_put((q, codes), host_dev)
    out_h, lse_h, num_sampled = host_part(q_h, codes_h, host_state, impl=impl, max_threads=max_threads)
    out_h, lse_h = jax.device_put((out_h, lse_h), accel)
    out, lse = merge_part(out_h, lse_h, out_s, lse_s)
    return out, lse, num_sampled
