"""The host-op entries: MagicPIG (one device, a mesh, or offloaded from an accelerator), TopK and Quest."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from magicpig_jax.attention import budget_tokens
from magicpig_jax.attention.baselines import quest_rows_read
from magicpig_jax.models.backends.pure import build_range as _build_range
from magicpig_jax.models.backends.spec import (
    Backend,
    DecodeSpec,
    MiddleRange,
    _no_sparse_layer,
    decode_range_lengths,
    layer_projections,
)

__all__ = ["ENTRIES", "HostOps", "append_due", "sharded"]

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
    # a prompt shorter than num_sink: the range starts at num_sink (decode_range_lengths)
    lengths = decode_range_lengths(lengths, spec.magicpig.num_sink, k.shape[2])
    return _ops_of(spec).build_index(k, proj, spec.magicpig, lengths, capacity=capacity)


def _attend_host(spec, q, k, v, state, lengths, key):
    return _ops_of(spec).attention(q, k, v, state, spec.magicpig, lengths, softcap=spec.logit_softcap)


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


def _attend_dense_host(q, k, v, lengths, starts=None, *, softcap=None):
    from magicpig_jax.host import host_exact_attention

    # One pass over each KV head's keys for its G query heads, K/V read in place.
    return host_exact_attention(q, k, v, lengths, starts, softcap=softcap)


# ------------------------------------------------------------------------------------------
# MagicPIG as the paper's system on an accelerator: KV cache and index in host memory.
# ------------------------------------------------------------------------------------------


def _build_offload(spec, k, lengths, layer, capacity):
    # Inside the accelerator's jit only the hyperplanes; prepare places the rest.
    return layer_projections(spec.magicpig, layer, k.shape[-1])


def _attend_offload(*args, **kwargs):
    raise ValueError("the offload backend runs its own decode step (make_step), not attend inside jit")


def _prepare_offload(spec, cache, states):
    from magicpig_jax import offload_decoder as offload

    return offload.place_decode_state(spec, cache, states)


def _make_offload_step(graphdef, state_treedef, spec):
    from magicpig_jax import offload_decoder as offload

    return offload.OffloadDecodeStep(graphdef, state_treedef, spec)


# ------------------------------------------------------------------------------------------
# TopK and Quest in host ops (CPU), and the hybrid estimator (pure JAX).
# ------------------------------------------------------------------------------------------


def _host_range(spec, k, state, lengths):
    """``(start, end)`` of the range a host TopK attends: ``[num_sink, min(end, lengths))``, the
    start clipped to the context (the op attends the sinks ``[0, start)`` as they are: while the
    context is shorter than ``num_sink``, positions past it hold no key yet)."""
    s0 = min(spec.magicpig.num_sink, k.shape[2])
    start = jnp.minimum(jnp.int32(s0), lengths).astype(jnp.int32)
    return start, jnp.maximum(jnp.minimum(state.end, lengths), start)


def _due(spec, end, lengths):
    return (lengths - end) >= spec.static_window


def _attend_topk_host(spec, q, k, v, state: MiddleRange, lengths, key):
    from magicpig_jax.host.topk import host_topk_attention

    start, end = _host_range(spec, k, state, lengths)
    # one pass: the top keys of the range and the static set [0, start) u [end, lengths) in one softmax
    out, lse = host_topk_attention(q, k, v, spec.budget, end, start=start, context=lengths,
                                   softcap=spec.logit_softcap)
    n = end - start
    used = jnp.broadcast_to(jnp.minimum(budget_tokens(spec.budget, n), n)[:, None], q.shape[:2]).astype(jnp.int32)
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

    # one pass: the kept pages and the static set [0, start) u [end, lengths) in one softmax. While the
    # context is shorter than the range's start (num_sink) the range is empty: it moves to the context's
    # end, so that the sinks [0, start) hold only written positions.
    short = lengths < state.start
    state = dataclasses.replace(state, start=jnp.where(short, lengths, state.start),
                                end=jnp.where(short, lengths, state.end))
    out, lse = host_quest_attention(q, k, v, state, spec.budget, context=lengths, softcap=spec.logit_softcap)
    n = state.end - state.start
    used = quest_rows_read(spec.budget, n, spec.page_size)  # as the pure-JAX entry counts it
    used = jnp.broadcast_to(used[:, None], q.shape[:2]).astype(jnp.int32)
    return out, lse, used


def _after_step_quest(spec, state, k, lengths):
    from magicpig_jax.host.quest import quest_append_pages

    T = spec.generation_buffer
    due = _due(spec, state.end, lengths)
    return jax.lax.cond(jnp.any(due), lambda st: quest_append_pages(st, k, jnp.where(due, T, 0), T),
                        lambda st: st, state)


ENTRIES: dict[str, Backend] = {
    # Dense decoding on the CPU backend: every layer through the host exact op, which reads a
    # bfloat16 cache in place (XLA's dense attention converted the whole cache to float32 each step).
    "dense-host": Backend("dense (host exact op)", build=_no_sparse_layer, attend=_no_sparse_layer,
                          attend_dense=_attend_dense_host),
    "magicpig-host": Backend("magicpig (host op)", build=_build_host, attend=_attend_host, after_step=append_due,
                             prepare=_prepare_host, attend_dense=_attend_dense_host, validate=_validate_host),
    "magicpig-host-sharded": Backend("magicpig (host op, sharded)", build=_build_host, attend=_attend_host,
                                     after_step=append_due, prepare=_prepare_host, validate=_validate_host),
    "magicpig-offload": Backend("magicpig (offload: KV cache and index in host memory, host op)",
                                build=_build_offload, attend=_attend_offload, prepare=_prepare_offload,
                                validate=_validate_host, make_step=_make_offload_step),
    "topk-host": Backend("topk (host op)", build=_build_range, attend=_attend_topk_host,
                         after_step=_after_step_range, prepare=_prepare_host, attend_dense=_attend_dense_host),
    "quest-host": Backend("quest (host op)", build=_build_quest_host, attend=_attend_quest_host,
                          after_step=_after_step_quest, prepare=_prepare_host, attend_dense=_attend_dense_host),
}
