"""The decoder on an accelerator: the ``"magicpig-offload"`` entry of :mod:`magicpig_jax.models.backends`.

Every sparse layer's KV cache and LSH index stay on the host device for the whole decode
(:func:`place_decode_state`); the accelerator keeps the hyperplanes, the sinks and a ring of
the last W positions. Each step (:class:`OffloadDecodeStep`) runs as jitted accelerator
segments, from one sparse layer to the next, alternating with one host computation per sparse
layer (:mod:`magicpig_jax.offload` has the per-layer split and its transfer pattern). Its GPU
runs are in docs/benchmarks.md ("On a GPU").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from magicpig_jax import host, lsh
from magicpig_jax.attention._common import softcap_logits
from magicpig_jax.attention.dense import dense_attention
from magicpig_jax.attention.merge import merge_attention
from magicpig_jax.models.cache import write_token
from magicpig_jax.models.config import first_visible_key
from magicpig_jax.models.llama import rope_tables

__all__ = ["OffloadLayer", "OffloadDecodeStep", "place_decode_state"]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["projections", "sink_k", "sink_v", "sink_len", "ring_k", "ring_v", "end", "index"],
                   meta_fields=[])
@dataclasses.dataclass
class OffloadLayer:
    """One sparse layer's decode state in the offload decoder.

    On the accelerator: ``projections`` float32 ``[D, K*L]``; the sinks ``sink_k/sink_v``
    ``[B, Hkv, S, D]`` (row b's first ``sink_len[b]`` valid); a ring of the last ``W`` positions
    ``ring_k/ring_v`` ``[B, Hkv, W, D]`` (position p in slot ``p % W``; ``W`` = the decoder's
    static window), which every step writes its token into; ``end`` int32 ``[B]``, the index's
    hashed end (positions ``>= end`` are not in the index yet).
    In host memory: ``index``, the layer's :class:`~magicpig_jax.host.HostIndex` (the layer's KV
    cache is in the decoder's :class:`~magicpig_jax.models.cache.KVCache`, also in host memory).
    """

    projections: jax.Array
    sink_k: jax.Array
    sink_v: jax.Array
    sink_len: jax.Array
    ring_k: jax.Array
    ring_v: jax.Array
    end: jax.Array
    index: host.HostIndex


@functools.partial(jax.jit, static_argnames=("num_sink", "window"))
def _accel_layer(k, v, lengths, start, end, projections, *, num_sink: int, window: int) -> OffloadLayer:
    """The accelerator part of a layer from its full cache (on the accelerator, once after prefill)."""
    B, _, N, _ = k.shape
    S = min(num_sink, N)
    slots = jnp.arange(window, dtype=jnp.int32)[None, :]
    pos = lengths[:, None] - 1 - jnp.remainder(lengths[:, None] - 1 - slots, window)  # latest p < len, p = s mod W
    idx = jnp.clip(pos, 0, N - 1)
    return OffloadLayer(
        projections=projections, sink_k=k[:, :, :S], sink_v=v[:, :, :S],
        sink_len=jnp.minimum(start, lengths).astype(jnp.int32),
        ring_k=jnp.take_along_axis(k, idx[:, None, :, None], axis=2),
        ring_v=jnp.take_along_axis(v, idx[:, None, :, None], axis=2),
        end=end.astype(jnp.int32), index=None)


_host_build = jax.jit(host.host_build_index, static_argnames=("config", "capacity"))


def place_decode_state(spec, cache, states):
    """Offload's ``prepare``: move each sparse layer's K/V to the host device, build its index there,
    and keep on the accelerator only its hyperplanes, sinks and the ring of the last W positions.

    Args:
      spec: the :class:`~magicpig_jax.models.backends.DecodeSpec` (``offload``).
      cache: the prefilled :class:`~magicpig_jax.models.cache.KVCache` on the accelerator.
      states: per layer, the hyperplanes ``[D, K*L]`` of a sparse layer (None for a dense one).

    Returns:
      ``(cache, states)``: the cache with the sparse layers' K/V on the host device (the dense
      layers' stay on the accelerator), and an :class:`OffloadLayer` per sparse layer.
    """
    from magicpig_jax.models.backends.spec import decode_range_lengths
    from magicpig_jax.models.cache import KVCache

    accel, host_dev = spec.offload_devices()
    sparse = spec.sparse_layers(len(cache.k))
    k_layers, v_layers, out = list(cache.k), list(cache.v), list(states)
    lengths_a = jax.device_put(cache.lengths, accel)
    lengths_h = jax.device_put(cache.lengths, host_dev)
    for i in sparse:
        k_h, v_h, proj_h = jax.device_put((cache.k[i], cache.v[i], states[i]), host_dev)
        # a prompt shorter than num_sink: the range starts at num_sink (decode_range_lengths); the
        # sinks fill as the tokens are generated (_ring_write)
        index = _host_build(k_h, proj_h, spec.magicpig,
                            decode_range_lengths(lengths_h, spec.magicpig.num_sink, cache.capacity),
                            capacity=cache.capacity)
        start, end = jax.device_put((index.start, index.end), accel)
        layer = _accel_layer(jax.device_put(cache.k[i], accel), jax.device_put(cache.v[i], accel), lengths_a, start,
                             end, jax.device_put(states[i], accel), num_sink=spec.magicpig.num_sink,
                             # a ring past the cache's capacity holds nothing more (positions < capacity)
                             window=min(spec.static_window, cache.capacity))
        layer.index = index
        k_layers[i], v_layers[i], out[i] = k_h, v_h, layer
    for i in set(range(len(k_layers))) - set(sparse):  # the dense layers stay, committed to the accelerator
        k_layers[i], v_layers[i] = jax.device_put((k_layers[i], v_layers[i]), accel)
    host.advise_huge_pages([k_layers[i] for i in sparse], [v_layers[i] for i in sparse],
                           [out[i].index for i in sparse])
    return KVCache(k=tuple(k_layers), v=tuple(v_layers), lengths=lengths_a), tuple(out)


# --- the accelerator's computations of one step --------------------------------------------


def _qkv(layer, inv_freq, x, pos):
    q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), pos[:, None], inv_freq)
    return q[:, 0], k[:, 0], v[:, 0]


def _finish(layer, x, out):
    B = x.shape[0]
    return layer.add_mlp(layer.add_attention(x, out.reshape(B, 1, -1)))


_PACKABLE_FLOATS = ("float16", "bfloat16", "float32")  # widened to float32 exactly
_PACKABLE_WORDS = ("int32", "uint32")


def _pack(*arrays):
    """``uint32 [B, n]``: the arrays' float32 or 32-bit bits, row by row, concatenated (one transfer).

    Raises:
      TypeError: an array of another dtype (float64 would be narrowed, a 64-bit integer split).
    """
    B, words = arrays[0].shape[0], []
    for a in arrays:
        name = jnp.dtype(a.dtype).name
        if name not in _PACKABLE_FLOATS + _PACKABLE_WORDS:
            raise TypeError(f"_pack takes {_PACKABLE_FLOATS + _PACKABLE_WORDS} arrays, got {name}")
        a = a.astype(jnp.float32) if name in _PACKABLE_FLOATS else a
        words.append(jax.lax.bitcast_convert_type(a, jnp.uint32).reshape(B, -1))
    return jnp.concatenate(words, axis=1)


def _unpack(packed, layout):
    """The arrays of :func:`_pack` back from ``packed`` ``uint32 [B, n]``; ``layout``: ``(dtype, shape
    without B)`` per array (floating ones come back as float32).

    Raises:
      ValueError: the layout does not cover the ``n`` columns exactly.
    """
    B, at, out = packed.shape[0], 0, []
    for dtype, shape in layout:
        n = 1
        for d in shape:
            n *= d
        bits = packed[:, at:at + n].reshape((B, *shape))
        out.append(jax.lax.bitcast_convert_type(bits, jnp.dtype(dtype)) if jnp.dtype(dtype) != jnp.uint32 else bits)
        at += n
    if at != packed.shape[1]:
        raise ValueError(f"the layout covers {at} of the packed array's {packed.shape[1]} columns")
    return out


def _up_layout(Hq: int, Hkv: int, D: int, L: int):
    """Layout of what goes to the host per sparse layer: ``q``, its codes, the token's ``k`` and ``v``."""
    return (("float32", (Hq, D)), ("uint32", (Hq, L)), ("float32", (Hkv, D)), ("float32", (Hkv, D)))


def _down_layout(Hq: int, D: int):
    """Layout of what comes back: the host part's ``out`` and ``lse`` and the index's hashed end."""
    return (("float32", (Hq, D)), ("float32", (Hq,)), ("int32", ()))


def _static_attention(q, k_new, v_new, st: OffloadLayer, pos, softcap: float | None = None):
    """Exact attention over the sinks, the ring's positions ``[max(end, pos - W), pos)`` and the new
    token itself (one softmax over ``S + W + 1`` keys; logits soft-capped by ``softcap``)."""
    from magicpig_jax.attention._common import grouped_logits, masked_softmax_attention

    B, S, W = q.shape[0], st.sink_k.shape[2], st.ring_k.shape[2]
    slots = jnp.arange(W, dtype=jnp.int32)[None, :]
    p = pos[:, None] - 1 - jnp.remainder(pos[:, None] - 1 - slots, W)
    ring_ok = (p >= 0) & (p >= st.end[:, None])
    sink_ok = jnp.arange(S, dtype=jnp.int32)[None, :] < st.sink_len[:, None]
    keys = jnp.concatenate([st.sink_k.astype(jnp.float32), st.ring_k.astype(jnp.float32),
                            k_new[:, :, None].astype(jnp.float32)], axis=2)
    vals = jnp.concatenate([st.sink_v.astype(jnp.float32), st.ring_v.astype(jnp.float32),
                            v_new[:, :, None].astype(jnp.float32)], axis=2)
    mask = jnp.concatenate([sink_ok, ring_ok, jnp.ones((B, 1), bool)], axis=1)[:, None, None, :]
    return masked_softmax_attention(grouped_logits(q, keys, softcap), mask, vals)


def _ring_write(st: OffloadLayer, k_new, v_new, pos) -> OffloadLayer:
    """The token at ``pos`` written into the ring, and into the sinks while ``pos < S`` (a prompt
    shorter than ``num_sink``: the generated tokens that fill the sinks are sinks, never hashed)."""
    B, Hkv, W = st.ring_k.shape[0], st.ring_k.shape[1], st.ring_k.shape[2]
    rows, heads = jnp.arange(B)[:, None], jnp.arange(Hkv)[None, :]
    slot = jnp.remainder(pos, W)[:, None]
    st = dataclasses.replace(st, ring_k=st.ring_k.at[rows, heads, slot].set(k_new.astype(st.ring_k.dtype)),
                             ring_v=st.ring_v.at[rows, heads, slot].set(v_new.astype(st.ring_v.dtype)))
    S = st.sink_k.shape[2]
    if S == 0:
        return st
    sink = (pos < S)[:, None, None]
    at = jnp.minimum(pos, S - 1)[:, None]
    old_k, old_v = st.sink_k[rows, heads, at], st.sink_v[rows, heads, at]
    return dataclasses.replace(
        st, sink_k=st.sink_k.at[rows, heads, at].set(jnp.where(sink, k_new.astype(st.sink_k.dtype), old_k)),
        sink_v=st.sink_v.at[rows, heads, at].set(jnp.where(sink, v_new.astype(st.sink_v.dtype), old_v)),
        sink_len=jnp.where(pos < S, jnp.maximum(st.sink_len, pos + 1), st.sink_len).astype(jnp.int32))


def _dense_layer(layer, inv_freq, x, pos, k_cache, v_cache, window: int | None = None,
                 softcap: float | None = None):
    q, k, v = _qkv(layer, inv_freq, x, pos)
    # a sliding-window layer: the query at pos sees pos - W + 1 .. pos (itself merged below)
    starts = None if window is None else first_visible_key(pos, window)
    out, lse = dense_attention(q, k_cache, v_cache, pos, starts, softcap=softcap)
    G = q.shape[1] // k.shape[1]
    self_lse = jnp.sum(q.astype(jnp.float32) * jnp.repeat(k.astype(jnp.float32), G, axis=1), axis=-1)
    self_lse = softcap_logits(self_lse / jnp.sqrt(jnp.float32(q.shape[-1])), softcap)
    out, _ = merge_attention(out, lse, jnp.repeat(v.astype(jnp.float32), G, axis=1), self_lse)
    return _finish(layer, x, out), write_token(k_cache, k, pos), write_token(v_cache, v, pos)


def _segment(plan, parts, inv_freq, x, pos, pending, pending_state, dense_kv, next_state, *, K: int, L: int,
             windows: tuple = (), softcap: float | None = None):
    """One run of accelerator work between two host calls.

    ``plan = (graphdef of the embedding or None, graphdef of the sparse layer being finished or None,
    graphdefs of the dense layers, graphdef of the next sparse layer or None, graphdef of the head or
    None)``; ``parts`` their states. In order: embed the tokens (first segment) or finish the pending
    sparse layer (merge its host part with its static part, output projection, MLP; write its token
    into its ring), run the dense layers, then either the next sparse layer's queries, codes and
    static attention, or the final norm and logits (last segment). ``windows``: each dense layer's
    sliding window or None; ``softcap``: the model's attention logit soft-capping (Gemma 2) or None.
    """
    g_embed, g_pending, g_dense, g_next, g_head = plan
    p_embed, p_pending, p_dense, p_next, p_head = parts
    if g_embed is not None:
        x = _embed(nnx.merge(g_embed, p_embed), x)
    if g_pending is not None:
        down, out_s, lse_s, k_new, v_new = pending
        out_h, lse_h, end = _unpack(down, _down_layout(out_s.shape[1], out_s.shape[2]))
        out, _ = merge_attention(out_h, lse_h, out_s, lse_s)
        x = _finish(nnx.merge(g_pending, p_pending), x, out)
        pending_state = dataclasses.replace(_ring_write(pending_state, k_new, v_new, pos), end=end)
    new_kv = []
    for g, p, (k_c, v_c), window in zip(g_dense, p_dense, dense_kv, windows or (None,) * len(g_dense), strict=True):
        x, k_c, v_c = _dense_layer(nnx.merge(g, p), inv_freq, x, pos, k_c, v_c, window, softcap)
        new_kv.append((k_c, v_c))
    if g_next is not None:
        q, k_new, v_new = _qkv(nnx.merge(g_next, p_next), inv_freq, x, pos)
        codes = lsh.simhash_codes(q, next_state.projections, K, L)
        out_s, lse_s = _static_attention(q, k_new, v_new, next_state, pos, softcap)
        return x, pending_state, tuple(new_kv), (_pack(q, codes, k_new, v_new), k_new, v_new, out_s, lse_s)
    head = nnx.merge(g_head, p_head)
    logits = head.logits(head.norm(x)[:, 0])
    return x, pending_state, tuple(new_kv), logits


@functools.partial(jax.jit, static_argnames=("spec", "num_heads"), donate_argnames=("k_cache", "v_cache", "index"))
def _host_layer(up, pos, k_cache, v_cache, index, *, spec, num_heads: int):
    """On the host device: the sampled attention over the layer's cache (positions ``< pos``; the
    last W are the accelerator's), then the new token written at ``pos`` and the index's append
    when a generation buffer is due. ``up``: the packed ``(q, codes, k, v)`` (:func:`_up_layout`);
    returns the packed ``(out, lse, end)`` (:func:`_down_layout`), ``num_sampled`` and the state."""
    from magicpig_jax.models.backends import append_due

    _, Hkv, _, D = k_cache.shape
    q, codes, k_new, v_new = _unpack(up, _up_layout(num_heads, Hkv, D, spec.magicpig.L))
    out, lse, ns = host.host_sampled_attention(q, codes, k_cache, v_cache, index, pos, window=spec.static_window,
                                               softcap=spec.logit_softcap)
    # The barrier orders the cache writes after the op's reads, so XLA updates the donated cache in place.
    out, lse, ns, k_cache, v_cache = jax.lax.optimization_barrier((out, lse, ns, k_cache, v_cache))
    k_cache, v_cache = write_token(k_cache, k_new, pos), write_token(v_cache, v_new, pos)
    index = append_due(spec, index, k_cache, jnp.where(pos < k_cache.shape[2], pos + 1, pos))  # a full row: as written
    return _pack(out, lse, index.end), ns, k_cache, v_cache, index


def _shell(model):
    """The model without its layers (embedding, final norm, output projection, RoPE frequencies): an
    NNX module sharing those variables, so a computation that embeds or computes logits receives
    none of the layers' weights."""
    import copy

    shell = copy.copy(model)
    shell.layers = nnx.List([])
    return shell


def _embed(model, tokens):
    """``[B, 1, H]`` embeddings of ``tokens [B]`` (the model's own embedding, whichever form it has)."""
    embed = getattr(model, "embed", None)
    return embed(tokens[:, None]) if callable(embed) else model.embed_tokens(tokens[:, None])


def _accel_part(st: OffloadLayer | None) -> OffloadLayer | None:
    """The layer state without its host index (what an accelerator computation receives)."""
    return None if st is None else dataclasses.replace(st, index=None)


@functools.lru_cache(maxsize=64)
def _segment_fn(structure, K: int, L: int, windows: tuple = (), softcap: float | None = None):
    """The jitted :func:`_segment` of one structure (cached: every decode run of a model reuses it)."""
    return jax.jit(functools.partial(_segment, structure, K=K, L=L, windows=windows, softcap=softcap),
                   donate_argnames=("dense_kv", "pending_state"))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """:class:`OffloadDecodeStep`'s structure (no arrays): per segment ``(a, dense, b, jitted fn,
    parts treedef, parts' positions in leaves)``; ``inv_freq``: the positions of the RoPE tables
    (model, LongRoPE's long, the local layers'), None where the model has none."""

    config: object
    spec: object
    num_heads: int
    sparse: tuple
    segments: tuple
    inv_freq: tuple


class OffloadDecodeStep:
    """The decode step of the offload system (arXiv 2410.16179, Section 4.3), as the decoder calls it.

    ``step(leaves, cache, indices, tokens, base_key, t, temperature, top_p) -> (next_tokens, logits,
    num_sampled, cache, indices)``, like the jitted step of
    :func:`~magicpig_jax.models.decoding.compiled_decode_step`. One step is a chain of jitted
    computations: on the accelerator, a *segment* from one sparse layer to the next (finish the
    previous sparse layer, the dense layers in between, then the next sparse layer's query, its
    SimHash codes and the static attention over the sinks, the ring of the last W positions and
    the token itself); on the host device, that layer's sampled attention over its cache and index
    (the host op), the token's write into the cache and the index's append when due. Per sparse
    layer and step, ``q`` and its codes and the token's ``k, v`` go to the host
    (``B × (Hq (D + L) + 2 Hkv D) × 4`` bytes) and ``out, lse`` and the index's end come back
    (``B × (Hq (D + 1) + 1) × 4`` bytes), each direction packed into one ``uint32`` array: JAX moves
    an array between the accelerator's client and the CPU's by a synchronous copy of its own, so
    seven arrays per layer cost seven synchronous copies (docs/benchmarks.md, "On a GPU"). The keys
    never move.
    """

    def __init__(self, graphdef, state_treedef, spec):
        self.graphdef, self.treedef, self.spec = graphdef, state_treedef, spec
        self.accel, self.host = spec.offload_devices()
        self._plan: _Plan | None = None  # made on the first call, from the structure alone

    def _make_plan(self) -> _Plan:
        """The step's structure: segments, their jitted functions and where their weights are.

        Made from the graph definition and the state's tree structure alone (the model merged
        with each parameter's position in ``leaves`` in place of the array), so the step holds no
        weights (it lives in a cache shared by every model of this shape, and by threads): each
        call takes its weights from its own ``leaves``.
        """
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, list(range(self.treedef.num_leaves))))
        layers = [nnx.split(layer) for layer in model.layers]
        shell = nnx.split(_shell(model))
        spec = self.spec.with_softcap(model.config.attn_logit_softcap)  # Gemma 2's, for the host op
        n = len(layers)
        sparse = list(spec.sparse_layers(n))
        # Segments: [start or sparse layer i, dense layers ..., next sparse layer or the head].
        # One jitted function per distinct segment structure (equal layer graphdefs share it), made
        # here so that no step hashes a graphdef.
        bounds = [None, *sparse, None]
        segments, fns = [], {}
        K, L = spec.magicpig.K, spec.magicpig.L
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            dense = list(range(0 if a is None else a + 1, n if b is None else b))
            structure = (shell[0] if a is None else None, layers[a][0] if a is not None else None,
                         tuple(layers[i][0] for i in dense), layers[b][0] if b is not None else None,
                         shell[0] if b is None else None)
            windows = tuple(model.config.layer_window(i) for i in dense)
            if (structure, windows) not in fns:
                fns[structure, windows] = _segment_fn(structure, K, L, windows, spec.logit_softcap)
            parts = (shell[1] if a is None else None, layers[a][1] if a is not None else None,
                     tuple(layers[i][1] for i in dense), layers[b][1] if b is not None else None,
                     shell[1] if b is None else None)
            positions, parts_treedef = jax.tree.flatten(parts)
            segments.append((a, dense, b, fns[structure, windows], parts_treedef, tuple(positions)))

        def position(freq):
            return None if freq is None else freq.get_value()

        return _Plan(config=model.config, spec=spec, num_heads=model.config.num_heads, sparse=tuple(sparse),
                     segments=tuple(segments), inv_freq=(position(model.inv_freq), position(model.inv_freq_long),
                                                         position(model.inv_freq_local)))

    def __call__(self, leaves, cache, indices, tokens, base_key, t, temperature, top_p):
        """One decode step, with the arguments and results of
        :func:`magicpig_jax.models.decoding.compiled_decode_step`'s step (tokens int32 ``[B]``).

        Raises:
          ValueError: a sparse layer's sliding window is shorter than the cache (it must stay dense).
        """
        from magicpig_jax.models.cache import KVCache
        from magicpig_jax.models.decoding import sample_token

        plan = self._plan
        if plan is None:  # two threads' first calls may both make it: equal plans, either is kept
            plan = self._plan = self._make_plan()
        spec = plan.spec
        binding = sorted(set(plan.sparse) & set(plan.config.binding_windows(cache.capacity)))
        if binding:
            raise ValueError(f"layers {binding} attend through a sliding window shorter than this cache of "
                             f"{cache.capacity} positions: keep them in dense_layers (generation.decode_spec does)")
        # Committed to the accelerator, so the first step and the later ones share compiled segments.
        tokens, pos = jax.device_put((tokens, cache.lengths), self.accel)
        pos_h = jax.device_put(pos, self.host)
        k_layers, v_layers, states = list(cache.k), list(cache.v), list(indices)
        x, pending, counts = tokens, None, []
        # (the model's frequencies, LongRoPE's by each row's position [B, 1, D/2]; the local ones or None)
        inv_freq = rope_tables(plan.config, *(None if i is None else leaves[i] for i in plan.inv_freq), pos[:, None])
        for a, dense, b, segment, parts_treedef, positions in plan.segments:
            parts = jax.tree.unflatten(parts_treedef, [leaves[i] for i in positions])
            x, pend_state, new_kv, res = segment(
                parts, inv_freq, x, pos, pending, _accel_part(states[a] if a is not None else None),
                tuple((k_layers[i], v_layers[i]) for i in dense), _accel_part(states[b] if b is not None else None))
            if a is not None:
                states[a] = dataclasses.replace(pend_state, index=states[a].index)
            for i, (k_c, v_c) in zip(dense, new_kv, strict=True):
                k_layers[i], v_layers[i] = k_c, v_c
            if b is None:
                logits = res
                break
            # One array each way per sparse layer: a transfer between the accelerator's client and the
            # host's is a synchronous copy per array, which cost more than the host op itself on a GPU.
            up, k_new, v_new, out_s, lse_s = res
            st = states[b]
            down, ns, k_h, v_h, index = _host_layer(jax.device_put(up, self.host), pos_h, k_layers[b], v_layers[b],
                                                    st.index, spec=spec, num_heads=plan.num_heads)
            k_layers[b], v_layers[b] = k_h, v_h
            states[b] = dataclasses.replace(st, index=index)
            counts.append(ns)
            pending = (jax.device_put(down, self.accel), out_s, lse_s, k_new, v_new)
        next_tokens = _sample(logits, base_key, t, temperature, top_p, sample_token)
        num_sampled = jnp.stack(counts) if counts else jnp.zeros((0, tokens.shape[0], plan.num_heads), jnp.int32)
        # a full row writes nothing and keeps its length (decode_step's rule)
        new_cache = KVCache(k=tuple(k_layers), v=tuple(v_layers), lengths=jnp.where(pos < cache.capacity, pos + 1, pos))
        return next_tokens, logits, num_sampled, new_cache, tuple(states)


@functools.partial(jax.jit, static_argnames=("sample",))
def _sample(logits, base_key, t, temperature, top_p, sample):
    return sample(logits, jax.random.fold_in(base_key, t), temperature, top_p)
