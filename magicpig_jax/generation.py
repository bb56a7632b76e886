"""High-level generation: prompt -> prefill -> index build -> decode loop, with statistics.

``prefill`` and ``decode`` are separate so one prefill can be shared by several
decode backends (the CLI compares MagicPIG with dense on the same prefill).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from magicpig_jax.attention import MagicPIGConfig
from magicpig_jax.io.loader import LoadedModel
from magicpig_jax.models.backends import BACKENDS, DecodeSpec
from magicpig_jax.models.cache import KVCache
from magicpig_jax.models.config import default_dense_layers
from magicpig_jax.models.decoding import (
    build_indices,
    compiled_decode_step,
    hidden_to_logits,
    prefill_chunk,
    sample_token,
)

__all__ = ["PrefillState", "Generation", "prefill", "decode", "generate", "encode_prompt", "forward_logits", "CHUNK"]

CHUNK = 256  # prefill chunk (tokens); the cache capacity is a multiple of it


@dataclasses.dataclass
class PrefillState:
    """The result of a dense prefill, shared by decode runs.

    Attributes:
      cache: the :class:`KVCache` holding the prompts.
      last_logits: float32 ``[B, V]`` next-token logits after each prompt.
      prompt_lengths: ``[B]`` prompt lengths (tokens).
      seconds: prefill wall time (including compilation of the chunk function).
    """

    cache: KVCache
    last_logits: jax.Array
    prompt_lengths: np.ndarray
    seconds: float


@dataclasses.dataclass
class Generation:
    """What :func:`generate` returns.

    Attributes:
      text: the decoded continuation (special tokens removed).
      token_ids: the generated ids (EOS included if it was produced).
      stats: dict with ``prompt_tokens``, ``prefill_seconds``, ``decode_tokens``,
        ``decode_seconds`` (steps after the first), ``decode_tokens_per_s`` (rows x
        steps per second, excluding the first step), ``compile_seconds`` (the
        first step: compilation plus one step),
        ``attention``, ``sampled_fraction_per_layer`` (layer -> mean fraction of
        the context's keys sampled per decode step), ``sampled_fraction``
        (mean over the sparse layers), ``dense_layers``.
    """

    text: str
    token_ids: list[int]
    stats: dict


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def kv_cache_dtype(name: str):
    """The JAX dtype of a KV-cache storage name (``"float32"`` or ``"bfloat16"``).

    Raises:
      ValueError: any other name.
    """
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"kv_dtype must be 'float32' or 'bfloat16', got {name!r}")
    return jnp.float32 if name == "float32" else jnp.bfloat16


def encode_prompt(model: LoadedModel, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of the user's ``prompt``, wrapped in the model's chat template unless ``chat=False``."""
    if chat:
        prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return model.tokenizer.encode(prompt)


def prefill(model: LoadedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
            allow_beyond_context: bool = False, cache_dtype=jnp.float32) -> PrefillState:
    """Dense, chunked prefill of a batch of token-id prompts (right-padded).

    Args:
      model: the loaded model.
      prompts: B lists of token ids (lengths may differ; each >= 1).
      max_new_tokens: decode budget; the cache capacity is
        ``round_up(max_len + max_new_tokens, CHUNK)``.
      allow_beyond_context: permit positions past the model's trained context
        (timing experiments only).
      cache_dtype: dtype of the KV cache.

    Returns:
      a :class:`PrefillState`.

    Raises:
      ValueError: an empty prompt, or a prompt longer than the model's context
        (``max_position_embeddings``) unless ``allow_beyond_context``.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    lengths = np.array([len(p) for p in prompts], np.int32)
    ctx = model.config.max_position_embeddings
    if lengths.max() > ctx and not allow_beyond_context:
        raise ValueError(
            f"prompt has {int(lengths.max())} tokens, longer than the model's context of {ctx} tokens"
        )
    B = len(prompts)
    capacity = _round_up(int(lengths.max()) + max_new_tokens + 1, CHUNK)
    padded = np.zeros((B, _round_up(int(lengths.max()), CHUNK)), np.int32)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
    graphdef, state = nnx.split(model.module)
    start = time.perf_counter()
    cache = KVCache.zeros(model.config, B, capacity, cache_dtype)
    lengths_j = jnp.asarray(lengths)
    last_hidden = np.zeros((B, model.config.hidden_size), np.float32)
    for s in range(0, padded.shape[1], CHUNK):
        hidden, cache = prefill_chunk(graphdef, state, cache, jnp.asarray(padded[:, s:s + CHUNK]),
                                      jnp.int32(s), lengths_j)
        rows = np.nonzero((lengths - 1 >= s) & (lengths - 1 < s + CHUNK))[0]
        if rows.size:
            h = np.asarray(hidden)
            last_hidden[rows] = h[rows, lengths[rows] - 1 - s]
    last_logits = hidden_to_logits(graphdef, state, jnp.asarray(last_hidden))
    last_logits.block_until_ready()
    return PrefillState(cache, last_logits, lengths, time.perf_counter() - start)


def decode(model: LoadedModel, state: PrefillState, *, attention: str = "magicpig",
           max_new_tokens: int = 64, config: MagicPIGConfig | None = None,
           dense_layers: Sequence[int] | None = None, seed: int = 0, temperature: float = 0.0,
           top_p: float = 1.0, stop_on_eos: bool = True, progress=None,
           budget: int | float | None = None, page_size: int = 16,
           forced_tokens: Sequence[Sequence[int]] | None = None,
           logits_callback=None, mesh=None) -> tuple[list[list[int]], dict]:
    """Decode from a prefill with one attention backend (the prefill cache is not consumed).

    Args:
      model: the loaded model.
      state: a :class:`PrefillState` (its cache is copied, so it can be reused).
      attention: one of :data:`magicpig_jax.models.backends.BACKENDS`
        (``"dense"``, ``"magicpig"``, ``"topk"``, ``"quest"``, ``"oracle"``).
      max_new_tokens: tokens to generate per row (stops earlier on EOS).
      config: MagicPIG configuration (default :class:`MagicPIGConfig()`).
      dense_layers: layers kept dense under MagicPIG (default
        :func:`default_dense_layers`: {0, 15} for SmolLM2's 30 layers).
      seed, temperature, top_p: sampling (temperature 0 = greedy).
      stop_on_eos: stop a row at the model's EOS token.
      progress: optional callable ``progress(n)`` called after each step.
      budget: keys per query head for "topk"/"quest"/"oracle" (int tokens or a
        fraction in (0, 1] of the middle range).
      page_size: Quest's page size.
      forced_tokens: teacher forcing: B lists of ``max_new_tokens`` ids fed instead
        of the sampled ones (the outputs are then these ids).
      logits_callback: optional ``callback(step, logits)`` receiving the float32
        ``[B, V]`` NumPy logits that predict token ``step`` (step 0 = the prefill's).
      mesh: optional ``("batch", "kv_heads")`` mesh from
        :func:`magicpig_jax.distributed.make_mesh`: the cache and the host indices are
        sharded over it and each device runs the host op on its own shard.

    Returns:
      ``(token_ids per row, stats dict)`` (see :class:`Generation` for the keys).

    Raises:
      ValueError: unknown attention, bad sampling parameters, or not enough cache capacity.
    """
    if attention not in BACKENDS:
        raise ValueError(f"attention must be one of {BACKENDS}, got {attention!r}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    cfg = config or MagicPIGConfig()
    n_layers = model.config.num_layers
    dl = tuple(sorted(set(default_dense_layers(n_layers) if dense_layers is None else dense_layers)))
    if any(not 0 <= i < n_layers for i in dl):
        raise ValueError(f"dense_layers must be in [0, {n_layers}), got {dl}")
    spec = DecodeSpec(backend=attention, magicpig=cfg, dense_layers=dl, budget=budget, page_size=page_size,
                      mesh=mesh)
    if forced_tokens is not None and (len(forced_tokens) != len(state.prompt_lengths)
                                      or any(len(f) < max_new_tokens for f in forced_tokens)):
        raise ValueError("forced_tokens needs one list of at least max_new_tokens ids per row")
    cache = state.cache.copy()
    if mesh is not None:
        from magicpig_jax import distributed as dist

        cache = jax.tree.map(lambda x: dist.shard_kv(mesh, x) if x.ndim == 4 else dist.shard_rows(mesh, x), cache)
    if int(state.prompt_lengths.max()) + max_new_tokens > cache.capacity:
        raise ValueError(f"max_new_tokens={max_new_tokens} exceeds the cache capacity {cache.capacity}")
    graphdef, params = nnx.split(model.module)
    leaves, treedef = jax.tree.flatten(params)
    step = compiled_decode_step(graphdef, treedef, spec)
    base_key = jax.random.key(seed)
    B = cache.lengths.shape[0]
    t0 = time.perf_counter()
    indices = build_indices(cache, spec, n_layers)
    jax.block_until_ready(indices)
    if spec.uses_host:
        from magicpig_jax.host import advise_huge_pages

        # The op reads rows of the cache and the index at random: back them with huge pages.
        sparse_layers = spec.sparse_layers(n_layers)
        advise_huge_pages([cache.k[i] for i in sparse_layers], [cache.v[i] for i in sparse_layers],
                          [indices[i] for i in sparse_layers])
    index_seconds = time.perf_counter() - t0
    first = jnp.argmax(state.last_logits, axis=-1).astype(jnp.int32)
    if temperature > 0:
        first = sample_token(state.last_logits, jax.random.fold_in(base_key, 0),
                             jnp.float32(temperature), jnp.float32(top_p))
    temp, tp = jnp.float32(temperature), jnp.float32(top_p)
    if forced_tokens is not None:
        first = jnp.asarray([f[0] for f in forced_tokens], jnp.int32)
    if logits_callback is not None:
        logits_callback(0, np.asarray(state.last_logits))
    eos = set(model.tokenizer.eos_token_ids) | set(model.config.eos_token_ids)
    outputs: list[list[int]] = [[] for _ in range(B)]
    done = np.zeros(B, bool)
    tokens = first
    sparse = spec.sparse_layers(n_layers)
    frac_sum = np.zeros(len(sparse))
    frac_steps = 0
    steps = 0
    compile_seconds = 0.0
    t0 = time.perf_counter()
    for t in range(max_new_tokens):
        tok = np.asarray(tokens)
        for b in range(B):
            if not done[b]:
                outputs[b].append(int(tok[b]))
                if stop_on_eos and int(tok[b]) in eos:
                    done[b] = True
        if done.all() or t == max_new_tokens - 1:
            break
        ctx = np.asarray(cache.lengths) + 1
        tokens, logits, num_sampled, cache, indices = step(leaves, cache, indices, tokens, base_key,
                                                           np.int32(t + 1), temp, tp)
        if forced_tokens is not None:
            tokens = jnp.asarray([f[t + 1] for f in forced_tokens], jnp.int32)
        if logits_callback is not None:
            logits_callback(t + 1, np.asarray(logits))
        steps += 1
        if steps == 1:  # the first step compiles; time the rest
            jax.block_until_ready(tokens)
            compile_seconds = time.perf_counter() - t0
            t0 = time.perf_counter()
        if sparse:
            ns = np.asarray(num_sampled, np.float64)  # [S, B, Hq]
            live = ~done
            frac_sum += (ns / ctx[None, :, None]).mean(axis=2)[:, live].mean(axis=1)
            frac_steps += 1
        if progress is not None:
            progress(1)
    seconds = time.perf_counter() - t0
    per_layer = ({int(layer): float(f / frac_steps) for layer, f in zip(sparse, frac_sum, strict=True)}
                 if frac_steps else {})
    stats = {
        "attention": attention,
        "prompt_tokens": [int(x) for x in state.prompt_lengths],
        "prefill_seconds": state.seconds,
        "decode_tokens": sum(len(o) for o in outputs),
        "decode_steps": steps,
        "decode_seconds": seconds,
        "decode_tokens_per_s": ((steps - 1) * B / seconds) if seconds > 0 and steps > 1 else float("nan"),
        "compile_seconds": compile_seconds,
        "index_build_seconds": index_seconds,
        "dense_layers": list(dl) if attention != "dense" else list(range(n_layers)),
        "magicpig": dataclasses.asdict(cfg) if attention != "dense" else None,
        "sampled_fraction_per_layer": per_layer,
        "sampled_fraction": float(np.mean(list(per_layer.values()))) if per_layer else None,
    }
    return outputs, stats


def generate(model: LoadedModel, prompt: str, *, attention: str = "magicpig", max_new_tokens: int = 128,
             config: MagicPIGConfig | None = None, seed: int = 0, chat: bool = True,
             temperature: float = 0.0, top_p: float = 1.0,
             dense_layers: Sequence[int] | None = None, kv_dtype: str = "float32") -> Generation:
    """Generate a reply to ``prompt`` with the chosen attention.

    Args:
      model: from :func:`magicpig_jax.load_model`.
      prompt: the user's message (the chat template is applied unless ``chat=False``).
      attention: ``"magicpig"`` (default) or ``"dense"``.
      max_new_tokens: maximum tokens to generate (stops at EOS).
      config: :class:`MagicPIGConfig` (default K=10, L=150, 4 sinks, 64 local).
      seed, temperature, top_p: sampling (temperature 0 = greedy).
      chat: apply the chat template.
      dense_layers: layers kept dense (default {0, num_layers // 2}).
      kv_dtype: storage of the KV cache, ``"float32"`` or ``"bfloat16"``.

    Returns:
      a :class:`Generation` with ``.text``, ``.token_ids``, ``.stats``.

    Raises:
      ValueError: prompt longer than the model's context, unknown attention, bad parameters.
    """
    ids = encode_prompt(model, prompt, chat)
    state = prefill(model, [ids], max_new_tokens, cache_dtype=kv_cache_dtype(kv_dtype))
    outs, stats = decode(model, state, attention=attention, max_new_tokens=max_new_tokens, config=config,
                         dense_layers=dense_layers, seed=seed, temperature=temperature, top_p=top_p)
    return Generation(model.tokenizer.decode(outs[0]), outs[0], stats)


def forward_logits(model: LoadedModel, ids: Sequence[int]) -> np.ndarray:
    """Dense causal forward of one sequence: float32 logits ``[T, V]`` at every position.

    Runs the same chunked prefill as decoding (so it tests that path).

    Raises:
      ValueError: empty ``ids`` or longer than the model's context.
    """
    state_ids = [list(ids)]
    if not state_ids[0]:
        raise ValueError("ids must be non-empty")
    T = len(ids)
    if T > model.config.max_position_embeddings:
        raise ValueError(f"{T} tokens exceed the model's context of {model.config.max_position_embeddings}")
    graphdef, params = nnx.split(model.module)
    padded = np.zeros((1, _round_up(T, CHUNK)), np.int32)
    padded[0, :T] = ids
    cache = KVCache.zeros(model.config, 1, padded.shape[1])
    out = []
    for s in range(0, padded.shape[1], CHUNK):
        hidden, cache = prefill_chunk(graphdef, params, cache, jnp.asarray(padded[:, s:s + CHUNK]),
                                      jnp.int32(s), jnp.asarray([T], jnp.int32))
        out.append(np.asarray(hidden_to_logits(graphdef, params, hidden))[0])
    return np.concatenate(out)[:T]
