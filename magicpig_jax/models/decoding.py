"""Pure decoding functions: chunked dense prefill, LSH index build, one jitted decode step.

Data flows prefill -> index build -> decode step. Every function takes the
model as ``(graphdef, state)`` (weights are jit arguments, never constants) and
the cache is donated so each step writes it in place.

Decode attention backends are in :mod:`magicpig_jax.models.backends`
(``"dense"``, ``"magicpig"`` (the host op on CPU), ``"magicpig-ref"``, ``"topk"``,
``"quest"``, ``"oracle"``); layers listed
in ``dense_layers`` stay dense under a sparse backend.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from magicpig_jax.attention import dense_attention, merge_attention
from magicpig_jax.attention._common import softcap_logits
from magicpig_jax.memory import LRUCache
from magicpig_jax.models.backends import (
    BACKENDS,
    DecodeSpec,
    SharedProjections,
    backend_for,
    drop_projections,
    layer_projections,
    projection_sources,
    resolve_projections,
)
from magicpig_jax.models.cache import KVCache, write_token

__all__ = [
    "BACKENDS",
    "DecodeSpec",
    "prefill_chunk",
    "build_indices",
    "decode_step",
    "compiled_decode_step",
    "layer_projections",
    "sample_token",
    "decode_queries",
    "hidden_to_logits",
]

def _causal_block_attention(q, k_cache, v_cache, chunk_start, chunk, window: int | None = None,
                            softcap: float | None = None):
    """Causal attention of a query chunk over the cache, block by block (online LSE merge).

    q ``[B, C, Hq, D]`` at positions ``chunk_start + 0..C-1``; k_cache, v_cache
    ``[B, Hkv, Nmax, D]`` already holding the chunk. Only key blocks up to the
    chunk are visited, so the cost is causal, not ``O(C * Nmax)``. With a sliding
    ``window`` W the query at position p sees keys ``p - W + 1 .. p`` only (transformers'
    ``sliding_window_overlay``), and blocks wholly before the chunk's first window are skipped.
    ``softcap`` c caps each logit to ``c * tanh(s / c)`` before the mask (Gemma 2).
    """
    B, C, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    qg = q.astype(jnp.float32).reshape(B, C, Hkv, G, D).transpose(0, 2, 3, 1, 4)  # [B,Hkv,G,C,D]
    q_pos = chunk_start + jnp.arange(C, dtype=jnp.int32)
    scale = jnp.float32(1.0 / math.sqrt(D))

    def body(j, carry):
        out, lse = carry
        start = j * chunk
        kb = jax.lax.dynamic_slice_in_dim(k_cache, start, chunk, axis=2).astype(jnp.float32)
        vb = jax.lax.dynamic_slice_in_dim(v_cache, start, chunk, axis=2).astype(jnp.float32)
        s = softcap_logits(jnp.einsum("bhgcd,bhnd->bhgcn", qg, kb, precision=jax.lax.Precision.HIGHEST) * scale,
                           softcap)
        k_pos = (start + jnp.arange(chunk, dtype=jnp.int32))[None, :]
        mask = k_pos <= q_pos[:, None]  # [C, n]
        if window is not None:
            mask = mask & (k_pos > q_pos[:, None] - window)
        s = jnp.where(mask, s, -jnp.inf)
        m = jnp.max(s, axis=-1)
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        e = jnp.exp(s - m_safe[..., None])
        tot = jnp.sum(e, axis=-1)
        o = jnp.einsum("bhgcn,bhnd->bhgcd", e, vb, precision=jax.lax.Precision.HIGHEST)
        # A block with no visible key has tot = 0 and is empty (lse -inf). A NaN score (a NaN weight,
        # activation or cache value; XLA's CPU max skips it) makes tot NaN: `~(tot <= 0)` keeps the
        # block, so the NaN reaches the output and the LSE instead of the block being dropped.
        # Visible keys whose scores are all -inf (a -inf in q or in every key): out NaN, lse -inf, as
        # masked_softmax_attention gives (merged with blocks that have finite scores, it weighs 0).
        live = ~(tot <= 0)
        o = o / jnp.where(live, tot, 1.0)[..., None]
        o = jnp.where(((tot == 0) & jnp.any(mask, axis=-1))[..., None], jnp.nan, o)
        lse_b = jnp.where(live, m_safe + jnp.log(jnp.where(live, tot, 1.0)), -jnp.inf)
        return merge_attention(out, lse, o, lse_b)

    init = (jnp.zeros((B, Hkv, G, C, D), jnp.float32), jnp.full((B, Hkv, G, C), -jnp.inf, jnp.float32))
    n_blocks = chunk_start // chunk + 1
    first = 0 if window is None else jnp.maximum(chunk_start - (window - 1), 0) // chunk
    out, _ = jax.lax.fori_loop(first, n_blocks, body, init)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, C, Hq, D)


# One traced and lowered function for every layer of a prefill chunk with the same shapes (each layer
# calls it instead of tracing its own copy of the block loop).
_causal_block_attention_call = jax.jit(_causal_block_attention, static_argnames=("chunk", "window", "softcap"))


@partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def prefill_chunk(graphdef, state, cache: KVCache, tokens, chunk_start, lengths):
    """Dense prefill of one chunk of ``C`` tokens for every row.

    Args:
      graphdef, state: ``nnx.split`` of the :class:`Llama`.
      cache: the :class:`KVCache` (donated); capacity a multiple of C.
      tokens: int32 ``[B, C]`` tokens at positions ``chunk_start .. chunk_start+C-1``
        (rows shorter than that are padded; padding is overwritten later).
      chunk_start: int32 scalar, a multiple of C.
      lengths: int32 ``[B]``, the final prompt length of each row (stored in the cache).

    Returns:
      ``(hidden [B, C, H] float32, cache)``.
    """
    model = nnx.merge(graphdef, state)
    B, C = tokens.shape
    positions = jnp.broadcast_to(chunk_start + jnp.arange(C, dtype=jnp.int32), (B, C))
    new_k, new_v = list(cache.k), list(cache.v)

    def write_kv(i, k, v):
        new_k[i] = jax.lax.dynamic_update_slice_in_dim(
            new_k[i], k.transpose(0, 2, 1, 3).astype(new_k[i].dtype), chunk_start, axis=2)
        new_v[i] = jax.lax.dynamic_update_slice_in_dim(
            new_v[i], v.transpose(0, 2, 1, 3).astype(new_v[i].dtype), chunk_start, axis=2)
        return new_k[i], new_v[i]

    def attend(i, q, k_cache, v_cache):
        return _causal_block_attention_call(q, k_cache, v_cache, chunk_start, C, model.config.layer_window(i),
                                            model.config.attn_logit_softcap)

    hidden = model.forward(tokens, positions, write_kv, attend, lengths)
    return hidden, KVCache(k=tuple(new_k), v=tuple(new_v), lengths=lengths.astype(jnp.int32))


@partial(jax.jit, static_argnames=("graphdef",))
def hidden_to_logits(graphdef, state, hidden):
    """Logits float32 ``[..., V]`` of final hidden states ``[..., H]``."""
    return nnx.merge(graphdef, state).logits(hidden)


def build_indices(cache: KVCache, spec: DecodeSpec, num_layers: int) -> tuple:
    """Per-layer decode state built after prefill by the spec's backend (:func:`backend_for`):
    an index or a hashed range for every sparse layer, None for the dense layers.

    Each sparse layer is built by its own program call, one after the other, so only one
    layer's temporaries exist at a time (e.g. its float32 projections ``[B, Hkv, N, K*L]``:
    393 MB for a Llama-3.1-8B layer at 8K tokens) and each is freed before the next layer
    starts; one program built all layers before, and XLA kept more than one layer's
    temporaries in its working memory. The layer number is an argument of that program
    (the layers share one compiled build) unless each layer has its own configuration
    (:class:`~magicpig_jax.attention.LayerConfigs`). Traceable (``jax.eval_shape``).

    With ``layers_per_projection > 1`` a layer whose SimHash matrix equals an earlier layer's
    (:func:`~magicpig_jax.models.backends.projection_sources`) is stored as
    :class:`~magicpig_jax.models.backends.SharedProjections`: no copy of the matrix, and the
    source layer recorded, so :func:`decode_step` hashes it with the matrix its keys were hashed
    with whatever spec it is given.

    Raises:
      ValueError: ``num_layers`` is not the cache's layer count.
    """
    if num_layers != len(cache.k):
        raise ValueError(f"num_layers must be the cache's layer count {len(cache.k)}, got {num_layers}")
    sparse = set(spec.sparse_layers(num_layers))
    # A layer whose matrix equals an earlier layer's keeps no copy of it (SharedProjections); not
    # under a backend with its own step (offload), whose states are the matrices alone.
    shared = projection_sources(spec, num_layers) if backend_for(spec).make_step is None else {}
    states = []
    for i in range(num_layers):
        if i not in sparse:
            states.append(None)
            continue
        if spec.layers is None:
            state = _build_layer(cache.k[i], cache.lengths, jnp.int32(i), spec, cache.capacity)
        else:
            state = _build_layer_configured(cache.k[i], cache.lengths, spec, i, cache.capacity)
        if i in shared:
            state = SharedProjections(drop_projections(state), shared[i])
        if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
            jax.block_until_ready(state)  # this layer's temporaries are gone before the next starts
        states.append(state)
    return tuple(states)


@partial(jax.jit, static_argnames=("spec", "capacity"))
def _build_layer(k, lengths, layer, spec: DecodeSpec, capacity: int):
    return backend_for(spec).build(spec, k, lengths, layer, capacity)


@partial(jax.jit, static_argnames=("spec", "layer", "capacity"))
def _build_layer_configured(k, lengths, spec: DecodeSpec, layer: int, capacity: int):
    return backend_for(spec).build(spec, k, lengths, layer, capacity)


def greedy_token(logits: Float[Array, "B V"]) -> Int[Array, " B"]:
    """``jnp.argmax(logits, axis=-1)`` as int32 ``[B]``: the first maximum, or the first NaN if any.

    Two plain reductions (max, then the least index holding it) instead of ``argmax``'s
    reduction over (value, index) pairs, which XLA's CPU backend does not vectorize: at a
    vocabulary of 49,152 that reduction was a visible part of a small model's decode step.
    Equal to ``jnp.argmax`` on every input (ties, infinities, NaN).
    """
    V = logits.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    first_nan = jnp.min(jnp.where(jnp.isnan(logits), iota, V), axis=-1)
    top = jnp.max(logits, axis=-1, keepdims=True)
    first_max = jnp.min(jnp.where(logits == top, iota, V), axis=-1)
    return jnp.where(first_nan < V, first_nan, first_max).astype(jnp.int32)


def check_token_ids(name: str, ids, vocab_size: int) -> None:
    """Refuse token ids that are not integers in ``[0, vocab_size)``: the embedding gather would
    read out of range (NaN logits) or wrap a negative id to the end of the vocabulary.

    Raises:
      TypeError: ``ids`` holds something other than integers (``name`` is named).
      ValueError: an id outside ``[0, vocab_size)`` (named, with ``name``).
    """
    arr = np.asarray(ids)
    if arr.size == 0:
        return
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) >= vocab_size:
        bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
        raise ValueError(f"{name} holds token id {bad}, outside the model's vocabulary [0, {vocab_size})")


def sample_token(logits, key, temperature, top_p):
    """Greedy (temperature == 0) or temperature + nucleus (top-p) sampling.

    Args:
      logits: float32 ``[B, V]``; key: a PRNG key; temperature, top_p: float32 scalars.

    Returns:
      int32 ``[B]``; -1 for a row whose logits contain NaN or ±inf (no distribution can be
      formed from NaN or +inf; a model's logits are finite, so -inf also means a weight or
      activation that is not finite, e.g. an infinite scale in a quantized block, where the
      float64 reference gives NaN; the decode loop raises ``FloatingPointError`` on it).

    Source: Holtzman et al. 2020 (nucleus sampling).
    """
    greedy = greedy_token(logits)

    def nucleus(_):
        # Sorting the vocabulary costs about 7 ms per step on CPU: only when sampling.
        # (logits − max) / T: near the max the difference is exact, so at a tiny T tied tokens stay
        # tied (logits / T rounded the Gumbel noise away, favouring the lowest id) and no floor on T
        # is needed; where T underflows, the limit: uniform over the maxima, −inf elsewhere.
        shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
        scaled = jnp.where(shifted == 0, 0.0, shifted / temperature)
        order = jnp.argsort(-scaled, axis=-1)
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        # always keeps the first; top_p = 1 keeps every token (the float32 sum reaches 1 before the tail)
        keep = ((cum - probs) < top_p) | (top_p >= 1)
        sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
        choice = jax.random.categorical(key, sorted_logits, axis=-1)
        return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

    token = jax.lax.cond(temperature > 0, nucleus, lambda _: greedy, None)
    broken = jnp.any(~jnp.isfinite(logits), axis=-1)
    return jnp.where(broken, -1, token).astype(jnp.int32)


def _decode_step(graphdef, state, cache: KVCache, indices, tokens, key, temperature, top_p, spec: DecodeSpec):
    """One decode step for every row: append ``tokens`` to the cache, attend, sample the next token.

    Args:
      graphdef, state: the split model.
      cache: :class:`KVCache` (donated); ``tokens`` go to position ``cache.lengths``.
      indices: per-layer decode state from :func:`build_indices` (donated: host indices
        are updated in place when generated tokens are appended).
      tokens: int32 ``[B]``.
      key: PRNG key for sampling; temperature, top_p: float32 scalars.
      spec: the static :class:`DecodeSpec`.

    Returns:
      ``(next_tokens int32 [B], logits float32 [B, V], num_sampled int32 [S, B, Hq], cache, indices)``,
      S = number of sparse layers (0 for dense).
    """
    model = nnx.merge(graphdef, state)
    spec = spec.with_softcap(model.config.attn_logit_softcap)  # Gemma 2: a spec built by hand gets the cap too
    backend = backend_for(spec)
    B = tokens.shape[0]
    pos = cache.lengths
    sparse = set(spec.sparse_layers(len(cache.k)))
    if len(indices) != len(cache.k):
        raise ValueError(f"indices must have one entry per layer ({len(cache.k)}), got {len(indices)}")
    unbuilt = sorted(i for i in sparse if indices[i] is None)
    if unbuilt:
        raise ValueError(f"layers {unbuilt} are sparse in the step's spec but have no index: build the indices "
                         "with the spec the step is given (its dense_layers)")
    binding = sorted(sparse & set(model.config.binding_windows(cache.capacity)))
    if binding:
        raise ValueError(
            f"layers {binding} attend through a sliding window of {model.config.sliding_window} tokens, shorter "
            f"than this cache of {cache.capacity} positions: they decode exactly over their window, so keep "
            "them in dense_layers (generation.decode_spec does)")
    counts = []
    new_kv = {}

    def write_kv(i, k, v):
        # Attention reads the cache as it was; the new token is merged in exactly and the
        # cache is written once at the end of the step (writing before reading made XLA
        # copy every layer's cache each step).
        new_kv[i] = (k[:, 0], v[:, 0])
        return cache.k[i], cache.v[i]

    def attend(i, q, k_cache, v_cache):
        if i in sparse:
            # A layer of a group hashes with the buffer of the group's first layer (SharedProjections).
            state = resolve_projections(indices, i)
            out, lse, n = backend.attend(spec, q[:, 0], k_cache, v_cache, state, pos,
                                         jax.random.fold_in(key, 1000 + i))
            counts.append(n)
        else:  # a sliding-window layer's query sees pos - W + 1 .. pos (itself merged below)
            out, lse = backend.attend_dense(q[:, 0], k_cache, v_cache, pos, model.config.window_start(i, pos),
                                            softcap=spec.logit_softcap)
        k_new, v_new = new_kv[i]
        self_out, self_lse = _self_attention(q[:, 0], k_new, v_new, spec.logit_softcap)
        out, _ = merge_attention(out, lse, self_out, self_lse)
        return out[:, None]

    hidden = model.forward(tokens[:, None], pos[:, None], write_kv, attend)
    logits = model.logits(hidden[:, 0])
    next_tokens = sample_token(logits, key, temperature, top_p)
    num_sampled = jnp.stack(counts) if counts else jnp.zeros((0, B, model.config.num_heads), jnp.int32)
    # The barrier orders every cache write after every attention read, so XLA updates the
    # donated cache in place instead of copying it.
    written, logits = jax.lax.optimization_barrier(([new_kv[i] for i in range(len(cache.k))], logits))
    write = write_token if spec.mesh is None else _sharded_write_token(spec.mesh)
    new_k = tuple(write(c, written[i][0], pos) for i, c in enumerate(cache.k))
    new_v = tuple(write(c, written[i][1], pos) for i, c in enumerate(cache.v))
    # A full row (pos == capacity) writes nothing and keeps its length. The decode loop steps such a
    # row only past its own limit (stopped at the context while other rows decode on), where its
    # tokens are never read; a row that still needs positions is refused first (check_capacity).
    lengths = jnp.where(pos < cache.capacity, pos + 1, pos)
    built, indices = indices, list(indices)
    for i in sparse:
        state = backend.after_step(spec, resolve_projections(built, i), new_k[i], lengths)
        shared = built[i]
        indices[i] = SharedProjections(drop_projections(state), shared.source) if isinstance(
            shared, SharedProjections) else state
    return next_tokens, logits, num_sampled, KVCache(k=new_k, v=new_v, lengths=lengths), tuple(indices)


def check_capacity(cache: KVCache, host_lengths: np.ndarray | None = None) -> None:
    """Refuse a decode step that would write past the cache: every row needs a free position.

    Args:
      cache: the :class:`KVCache` the step would write.
      host_lengths: int ``[B]``, the rows' lengths as the caller tracks them on the host (the
        decode loop: the prompt lengths plus the steps dispatched, each row at most at its own
        limit, past which its positions are not needed). Given, the check does not read
        ``cache.lengths``, so it does not wait for a step still running to produce them.

    Raises:
      ValueError: a row's length is already the capacity (read when ``cache.lengths`` is
        concrete; inside a trace the step itself leaves full rows unchanged).
    """
    if host_lengths is None and isinstance(cache.lengths, jax.core.Tracer):
        return
    lengths = np.asarray(cache.lengths if host_lengths is None else host_lengths)
    full = np.nonzero(lengths >= cache.capacity)[0]
    if full.size:
        raise ValueError(f"decode step past the cache: row(s) {full.tolist()} hold {lengths[full].tolist()} tokens, "
                         f"the capacity is {cache.capacity} (prefill with a larger max_new_tokens)")


def _sharded_write_token(mesh):
    """:func:`write_token` on each device's own rows and KV heads: on a batch-sharded cache XLA's
    partitioner replicated the cache for the per-row update (an all-gather of every layer's K and V
    over the batch axis, each step)."""
    from jax.sharding import PartitionSpec as P

    from magicpig_jax.distributed import BATCH, KV_HEADS, KV_SPEC, ROW_SPEC

    return jax.shard_map(write_token, mesh=mesh, in_specs=(KV_SPEC, P(BATCH, KV_HEADS, None), ROW_SPEC),
                         out_specs=KV_SPEC)


_decode_step_jit = partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("cache", "indices"))(
    _decode_step)


def decode_step(graphdef, state, cache: KVCache, indices, tokens, key, temperature, top_p, spec: DecodeSpec):
    """One jitted decode step for every row (cache and indices donated); see :func:`_decode_step`.

    Capacity: the new tokens go to position ``cache.lengths``, so every row must have one free
    position. A call with a full row raises ``ValueError`` (:func:`check_capacity`) before
    anything is written or donated. Traced inside another function (lengths not concrete), the
    step writes nothing for a full row and leaves its length unchanged (never a write clamped
    into the last slot).

    Args:
      graphdef, state: the model, split by ``nnx.split`` (``graphdef`` static).
      cache: the :class:`KVCache` (donated).
      indices: the per-layer decode states of ``spec``'s backend (donated; ``None`` for dense layers).
      tokens: int32 ``[B]``, each row's last token (written at position ``cache.lengths``).
      key: the PRNG key of this step's sampling.
      temperature, top_p: float32 scalars (temperature 0: greedy).
      spec: the :class:`DecodeSpec` (static).

    Returns:
      ``(next_tokens int32 [B], logits float32 [B, V], num_sampled int32 [S, B, Hq], cache, indices)``,
      S the number of sparse layers (``spec.sparse_layers``).

    Raises:
      ValueError: a row of ``cache`` is full.
    """
    check_capacity(cache)
    return _decode_step_jit(graphdef, state, cache, indices, tokens, key, temperature, top_p, spec=spec)


decode_step.lower = _decode_step_jit.lower


_STEP_CACHE = LRUCache()  # least recently used evicted first; shared by threads
_STEP_CACHE_SIZE = 64


def compiled_decode_step(graphdef, state_treedef, spec: DecodeSpec):
    """:func:`decode_step` specialised to one model and :class:`DecodeSpec`, with flat parameters.

    ``decode_step`` takes the NNX ``graphdef`` as a static argument and the parameter
    ``State`` as a pytree: every call then hashes the graph definition and flattens the
    state in Python, as long as a small model's step on CPU. The function returned here
    closes over both and is cached per (graphdef, treedef, spec), so a decode loop pays
    that once. Call it as ``step(leaves, cache, indices, tokens, base_key, t, temperature,
    top_p)`` with ``leaves = jax.tree.leaves(state)``; the sampling key is
    ``jax.random.fold_in(base_key, t)`` (int32 ``t``), computed inside the step. The keyword
    ``host_lengths`` (int ``[B]``) lets a caller that tracks the rows' lengths on the host
    skip reading them from the cache (:func:`check_capacity`).

    Returns:
      The step (cache and indices donated; the jitted function is its ``jitted`` attribute);
      its outputs are those of :func:`decode_step`. Like :func:`decode_step` it raises
      ``ValueError`` for a cache with a full row, before anything is written.
    """
    key = (graphdef, state_treedef, spec)  # hashed once per call here, not once per step
    hit = _STEP_CACHE.get(key)
    if hit is not None:
        return hit

    def step(leaves, cache, indices, tokens, base_key, t, temperature, top_p):
        state = jax.tree.unflatten(state_treedef, leaves)
        return _decode_step(graphdef, state, cache, indices, tokens, jax.random.fold_in(base_key, t), temperature,
                            top_p, spec)

    make_step = backend_for(spec).make_step  # a backend with its own step (offload: accelerator + host)
    if make_step:
        jitted = make_step(graphdef, state_treedef, spec)
    else:
        jitted = jax.jit(step, donate_argnames=("cache", "indices"))

    def fn(leaves, cache, indices, *args, host_lengths=None):
        check_capacity(cache, host_lengths)  # a full row: ValueError before anything is written (see decode_step)
        return jitted(leaves, cache, indices, *args)

    fn.jitted = jitted
    _STEP_CACHE.put(key, fn, _STEP_CACHE_SIZE)  # bounded: each entry holds compiled executables
    return fn


def _self_attention(q, k_new, v_new, softcap: float | None = None):
    """Attention of each query head ``[B, Hq, D]`` over its own token's key/value ``[B, Hkv, D]`` alone
    (its logit soft-capped by ``softcap``, Gemma 2)."""
    B, Hq, D = q.shape
    G = Hq // k_new.shape[1]
    k_rep = jnp.repeat(k_new.astype(jnp.float32), G, axis=1)
    v_rep = jnp.repeat(v_new.astype(jnp.float32), G, axis=1)
    lse = softcap_logits(jnp.sum(q.astype(jnp.float32) * k_rep, axis=-1) / jnp.float32(math.sqrt(D)), softcap)
    return v_rep, lse


@partial(jax.jit, static_argnames=("graphdef",))
def decode_queries(graphdef, state, cache: KVCache, tokens):
    """The decode-step queries of every layer, with dense attention (the cache is not modified).

    Args:
      graphdef, state: the split model; cache: a prefilled :class:`KVCache`;
      tokens: int32 ``[B]``, the token at position ``cache.lengths``.

    Returns:
      float32 ``[num_layers, B, Hq, D]`` (RoPE applied), for studies of attention.
    """
    model = nnx.merge(graphdef, state)
    pos = cache.lengths
    queries, new_kv = [], {}

    def write_kv(i, k, v):
        new_kv[i] = (k[:, 0], v[:, 0])
        return cache.k[i], cache.v[i]

    def attend(i, q, k_cache, v_cache):
        queries.append(q[:, 0].astype(jnp.float32))
        softcap = model.config.attn_logit_softcap
        # a sliding-window layer's query sees pos - W + 1 .. pos (itself merged below), as in decode
        out, lse = dense_attention(q[:, 0], k_cache, v_cache, pos, model.config.window_start(i, pos), softcap=softcap)
        self_out, self_lse = _self_attention(q[:, 0], *new_kv[i], softcap)
        return merge_attention(out, lse, self_out, self_lse)[0][:, None]

    model.forward(tokens[:, None], pos[:, None], write_kv, attend)
    return jnp.stack(queries)
