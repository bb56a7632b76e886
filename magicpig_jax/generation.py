"""High-level generation: prompt -> prefill -> index build -> decode loop, with statistics.

``prefill`` and ``decode`` are separate so one prefill can be shared by several
decode backends (the CLI compares MagicPIG with dense on the same prefill).
"""

from __future__ import annotations

import copy
import dataclasses
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from magicpig_jax.attention import HybridConfig, LayerConfigs, MagicPIGConfig
from magicpig_jax.attention.baselines import Budget
from magicpig_jax.attention.layer_configs import check_layer_indices
from magicpig_jax.decode_loop import Sampling, check_not_consumed, run_decode, start_decode
from magicpig_jax.io.loader import LoadedModel
from magicpig_jax.memory import compile_then_trim, note_program_shape
from magicpig_jax.models.backends import BACKENDS, BUDGETED, DecodeSpec
from magicpig_jax.models.cache import KVCache
from magicpig_jax.models.config import default_dense_layers
from magicpig_jax.models.decoding import (
    check_token_ids,
    hidden_to_logits,
    prefill_chunk,
)
from magicpig_jax.streaming import StopStrings, TextStream, check_stop_strings, check_stops_for

__all__ = ["PrefillState", "Generation", "Sampling", "prefill", "prefill_with_prefixes", "decode", "decode_spec",
           "generate", "encode_prompt", "forward_logits", "CHUNK"]

CHUNK = 256  # prefill chunk (tokens); the cache capacity is a multiple of it


@dataclasses.dataclass
class PrefillState:
    """The result of a dense prefill, shared by decode runs.

    Attributes:
      cache: the :class:`KVCache` holding the prompts.
      last_logits: float32 ``[B, V]`` next-token logits after each prompt.
      prompt_lengths: ``[B]`` prompt lengths (tokens).
      seconds: prefill wall time (including compilation of the chunk function).
      allow_beyond_context: whether positions past the model's context are allowed (timing
        experiments); decoding then stops only at the cache capacity.
      compile_seconds: the part of ``seconds`` spent compiling the chunk function (a short
        prompt's prefill is mostly that).
      shares_cache: the cache's buffers are another state's too (:func:`prefill_with_prefixes`):
        a decode must copy them (``consume_prefill=True`` is refused).
    """

    cache: KVCache
    last_logits: jax.Array
    prompt_lengths: np.ndarray
    seconds: float
    allow_beyond_context: bool = False
    compile_seconds: float = 0.0
    shares_cache: bool = False


@dataclasses.dataclass
class Generation:
    """What :func:`generate` returns.

    Attributes:
      text: the decoded continuation (special tokens removed; cut before a stop string).
      token_ids: the generated ids (EOS included if it was produced, and the token that completed
        a stop string: ``text`` is cut before either).
      stop_reason: why the row stopped: ``"eos"`` (an end-of-sequence / end-of-turn id),
        ``"stop"`` (a stop string), ``"length"`` (``max_new_tokens``) or ``"context"`` (the
        model's context is full).
      stats: what was asked — ``model``, ``attention``, ``attention_runs_on``, ``magicpig``
        (the config fields the backend reads: all for MagicPIG, the static set for TopK /
        Quest, and the seed for oracle; None for dense), ``layer_configs`` (the per-layer
        configs' JSON, or None), ``budget``, ``dense_layers``, ``sampling``, ``max_new_tokens``,
        ``stop`` — and what was measured: ``prompt_tokens``, ``prefill_seconds`` (wall
        time, including the compilation of the prefill chunk the first time a shape is
        seen), ``index_build_seconds`` (None for dense), ``compile_seconds`` (the first
        decode step: compilation plus one step), ``decode_steps``, ``decode_seconds``
        (steps after the first), ``decode_tokens_per_s`` (rows x steps per second after
        the first step; None with fewer than two steps), ``stop_reasons`` (per row),
        ``sampled_fraction_per_layer`` (layer -> mean fraction of the context's keys
        sampled per step) and ``sampled_fraction`` (their mean).
    """

    text: str
    token_ids: list[int]
    stats: dict
    stop_reason: str = "length"


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


Message = Mapping[str, object]
Prompt = str | Sequence[Message]
ROLES = ("system", "user", "assistant", "tool")


def _check_messages(messages: Sequence[Message]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise TypeError(f"prompt message {i} must be a mapping with 'role' and 'content', got {m!r}")
        if m["role"] not in ROLES:
            raise ValueError(f"prompt message {i} has role {m['role']!r}; allowed roles: {ROLES}")
        if not isinstance(m["content"], str):
            raise TypeError(f"prompt message {i} content must be a str, got {type(m['content']).__name__}")
        out.append(dict(m))
    if not out:
        raise ValueError("prompt must hold at least one message")
    return out


def encode_prompt(model: LoadedModel, prompt: Prompt, chat: bool = True, parse_special: bool = False) -> list[int]:
    """Token ids of one prompt: a user message (str) or a conversation (list of messages).

    With ``chat`` the model's chat template renders the conversation, and special tokens come
    only from the template: special-token strings in a message are literal text unless
    ``parse_special`` (:meth:`Tokenizer.encode_chat`). With ``chat=False`` the prompt must be
    a str, encoded as is with BOS/EOS as the model's tokenizer flags say; ``parse_special``
    then lets it contain control tokens (a raw prompt).

    Raises:
      TypeError / ValueError: a malformed prompt, a role outside :data:`ROLES`, or
        ``chat=False`` with messages.
    """
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, Sequence):
        messages = _check_messages(prompt)
    else:
        raise TypeError(f"prompt must be a str or a list of messages, got {type(prompt).__name__}")
    if not chat:
        if not isinstance(prompt, str):
            raise ValueError("chat=False takes a str prompt (a list of messages needs the chat template)")
        return model.tokenizer.encode(prompt, parse_special=parse_special, add_special_tokens=True)
    return model.tokenizer.encode_chat(messages, parse_special=parse_special)


def _prompt_batch(prompt) -> tuple[list[Prompt], bool]:
    """``(prompts, batched)``: a str or one conversation is one prompt; a list of those is a batch."""
    if isinstance(prompt, str):
        return [prompt], False
    if isinstance(prompt, Sequence) and prompt and all(isinstance(p, Mapping) for p in prompt):
        return [prompt], False
    if isinstance(prompt, Sequence) and prompt and all(isinstance(p, str | Sequence) for p in prompt):
        return list(prompt), True
    raise TypeError("prompt must be a str, a list of messages ({'role': ..., 'content': ...}), "
                    f"or a list of those (a batch); got {prompt!r}")


def prefill_with_prefixes(model: LoadedModel, prompts: Sequence[Sequence[int]], prefix_lengths: Sequence[int],
                          max_new_tokens: int, cache_dtype=jnp.float32) -> tuple[PrefillState, PrefillState]:
    """One dense prefill serving each prompt and its first ``prefix_lengths[b]`` tokens.

    Causal attention makes a prefix's keys, values and next-token logits independent of the
    tokens after it, so the prefix state is the prompt's cache with the row lengths cut to the
    prefixes (the two states share the cache buffers: a decode copies them, and
    ``consume_prefill=True``, which would delete the other state's, is refused) and the logits
    at each prefix's last position. ``magicpig-jax eval`` uses it for
    RULER's two setups of one sample (the question inside the prefill, or decoded after the
    document). A decode from the prefix state overwrites the cached positions past the prefix
    as it appends; nothing reads them before (every attention masks by the row lengths). Under
    LongRoPE a prompt longer than the pretrained context is rotated with the long factors, a
    prefix within it with the short ones (:func:`magicpig_jax.models.llama.rope_frequencies`):
    when a row's prefix and prompt fall on two sides of it, the prefixes get a prefill of their
    own (with room for the rest of the prompt and ``max_new_tokens``).

    Args:
      model, prompts, max_new_tokens, cache_dtype: as :func:`prefill` (capacity for the prompts).
      prefix_lengths: ``[B]`` ints, ``1 <= prefix_lengths[b] <= len(prompts[b])``.

    Returns:
      ``(state of the prompts, state of the prefixes)``; both report the one prefill's seconds.

    Raises:
      TypeError, ValueError: as :func:`prefill`; ValueError: a prefix length outside ``[1, len(prompt)]``.
    """
    check_prompt_lists(prompts)
    try:
        kind = np.asarray(prefix_lengths).dtype.kind if np.ndim(prefix_lengths) == 1 else None
    except (TypeError, ValueError):
        kind = None
    if kind not in ("i", "u"):  # ints (Python, NumPy or JAX); a float was cut to an int, a bool read as 0/1
        raise TypeError(f"prefix_lengths must be a list of ints, one per prompt, got {prefix_lengths!r}")
    if len(prefix_lengths) != len(prompts):
        raise ValueError(f"prefix_lengths has {len(prefix_lengths)} entries for {len(prompts)} prompts")
    for b, (n, p) in enumerate(zip(prefix_lengths, prompts, strict=True)):
        if not 1 <= int(n) <= len(p):
            raise ValueError(f"prefix_lengths[{b}] must be in [1, {len(p)}], got {n}")
    switch = model.config.longrope_switch
    if switch is not None and any(int(n) <= switch < len(p) for n, p in zip(prefix_lengths, prompts, strict=True)):
        full = prefill(model, prompts, max_new_tokens, cache_dtype=cache_dtype)
        extra = max(len(p) - int(n) for n, p in zip(prefix_lengths, prompts, strict=True)) + int(max_new_tokens)
        part = prefill(model, [list(p[:int(n)]) for n, p in zip(prefix_lengths, prompts, strict=True)], extra,
                       cache_dtype=cache_dtype)
        return full, part
    full, hidden = _prefill(model, prompts, max_new_tokens, False, cache_dtype, [int(n) for n in prefix_lengths])
    graphdef, params = nnx.split(model.module)
    prefix = np.asarray(prefix_lengths, np.int32)
    logits = hidden_to_logits(graphdef, params, jnp.asarray(hidden))
    cache = dataclasses.replace(full.cache, lengths=jnp.asarray(prefix))
    return (dataclasses.replace(full, shares_cache=True),
            PrefillState(cache, logits, prefix, full.seconds, full.allow_beyond_context, full.compile_seconds,
                         shares_cache=True))


def prefill(model: LoadedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
            allow_beyond_context: bool = False, cache_dtype=jnp.float32) -> PrefillState:
    """Dense, chunked prefill of a batch of token-id prompts (right-padded).

    Args:
      model: the loaded model.
      prompts: B lists of token ids (lengths may differ; each >= 1).
      max_new_tokens: decode budget; the cache capacity is
        ``round_up(max_len + max_new_tokens + 1, CHUNK)``, at most the context + 1 rounded
        up, unless ``allow_beyond_context``: decoding stops there anyway.
      allow_beyond_context: permit positions past the model's trained context
        (timing experiments only).
      cache_dtype: dtype of the KV cache: float32 or bfloat16 (what the decoders read).

    Returns:
      a :class:`PrefillState`. Its ``last_logits`` are NaN or ±inf where a weight, activation or
      cache value is not finite: not checked here, the decode loop raises ``FloatingPointError``
      on them before choosing a token.

    Raises:
      ValueError: an empty prompt, a token id outside ``[0, vocab_size)``, a prompt longer
        than the model's context (``max_position_embeddings``) unless ``allow_beyond_context``,
        ``max_new_tokens < 0``, or a ``cache_dtype`` other than float32 and bfloat16.
      TypeError: ``prompts`` not a list of token-id sequences, token ids that are not integers,
        a ``max_new_tokens`` that is not an int.
    """
    return _prefill(model, prompts, max_new_tokens, allow_beyond_context, cache_dtype, None)[0]


def cache_capacity(model: LoadedModel, longest_prompt: int, max_new_tokens: int,
                   allow_beyond_context: bool = False) -> int:
    """Positions of the KV cache :func:`prefill` allocates: ``round_up(longest_prompt +
    max_new_tokens + 1, CHUNK)``, at most the model's context + 1 rounded up (decoding stops
    there anyway, so a huge ``max_new_tokens`` allocates nothing it cannot use) unless
    ``allow_beyond_context``."""
    want = int(longest_prompt) + int(max_new_tokens) + 1  # a NumPy int would overflow in its own width
    if not allow_beyond_context:
        want = min(want, model.config.max_position_embeddings + 1)
    return _round_up(want, CHUNK)


def _check_max_new_tokens(max_new_tokens) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def check_prompt_lists(prompts) -> None:
    """Refuse ``prompts`` that are not a list (or tuple) of token-id sequences (a flat list of ids,
    a 2-D array) with a TypeError naming it (``len()`` of an int, or an array's truth value, failed).

    Raises:
      TypeError: as described.
    """
    if not isinstance(prompts, list | tuple):
        raise TypeError(f"prompts must be a list of token-id lists (one per row), got {type(prompts).__name__}")
    for b, p in enumerate(prompts):  # a row: any 1-D sequence or array of ids (list, range, NumPy or JAX)
        if isinstance(p, str | bytes) or np.ndim(p) != 1:
            raise TypeError(f"prompts must be a list of token-id lists (one per row); prompts[{b}] is "
                            f"{type(p).__name__}" + (f" of {np.ndim(p)} dimensions" if hasattr(p, 'ndim') else ""))


def check_cache_dtype(cache_dtype) -> jnp.dtype:
    """The KV cache dtype as a ``jnp.dtype``: float32 or bfloat16, the dtypes the decoders read
    (an integer cache stored the K and V rounded, and gave wrong logits without a word).

    Raises:
      ValueError: any other dtype, or a name that is not one (naming ``cache_dtype``).
    """
    try:
        dtype = jnp.dtype(cache_dtype)
    except TypeError:
        dtype = None
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"cache_dtype must be float32 or bfloat16, got {cache_dtype!r}")
    return dtype


def _prefill(model, prompts, max_new_tokens, allow_beyond_context, cache_dtype, also_at):
    """:func:`prefill`; with ``also_at`` (a length per row) also the hidden states after those
    lengths (float32 ``[B, H]``), else None."""
    check_prompt_lists(prompts)
    cache_dtype = check_cache_dtype(cache_dtype)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    for b, prompt in enumerate(prompts):
        check_token_ids(f"prompts[{b}]", prompt, model.config.vocab_size)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    lengths = np.array([len(p) for p in prompts], np.int32)
    ctx = model.config.max_position_embeddings
    if lengths.max() > ctx and not allow_beyond_context:
        row = f" {int(lengths.argmax())}" if len(prompts) > 1 else ""
        raise ValueError(
            f"prompt{row} has {int(lengths.max())} tokens, longer than the model's context of {ctx} tokens"
        )
    B = len(prompts)
    capacity = cache_capacity(model, int(lengths.max()), max_new_tokens, allow_beyond_context)
    # every cache shape compiles its own programs: hold those of at most a few shapes (memory.note_program_shape)
    note_program_shape((model.config, B, capacity, jnp.dtype(cache_dtype).name))
    padded = np.zeros((B, _round_up(int(lengths.max()), CHUNK)), np.int32)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
    graphdef, state = nnx.split(model.module)
    start = time.perf_counter()
    lengths_j = jnp.asarray(lengths)
    # Compile the chunk before the cache exists (memory.compile_then_trim): the compiler's
    # working memory and the cache are then never resident together.
    chunk = compile_then_trim(
        prefill_chunk, graphdef, state, jax.eval_shape(lambda: KVCache.zeros(model.config, B, capacity, cache_dtype)),
        jax.ShapeDtypeStruct((B, CHUNK), jnp.int32), jnp.int32(0), lengths_j)
    compile_seconds = time.perf_counter() - start
    cache = KVCache.zeros(model.config, B, capacity, cache_dtype)
    ends = [lengths] if also_at is None else [lengths, np.asarray(also_at, np.int32)]
    gathered = [np.zeros((B, model.config.hidden_size), np.float32) for _ in ends]
    for s in range(0, padded.shape[1], CHUNK):
        hidden, cache = chunk(state, cache, jnp.asarray(padded[:, s:s + CHUNK]), jnp.int32(s), lengths_j)
        for end, out in zip(ends, gathered, strict=True):
            rows = np.nonzero((end - 1 >= s) & (end - 1 < s + CHUNK))[0]
            if rows.size:
                out[rows] = np.asarray(hidden)[rows, end[rows] - 1 - s]
    last_logits = hidden_to_logits(graphdef, state, jnp.asarray(gathered[0]))
    last_logits.block_until_ready()
    done = PrefillState(cache, last_logits, lengths, time.perf_counter() - start, allow_beyond_context,
                        compile_seconds)
    return done, (gathered[1] if also_at is not None else None)


def decode_spec(model: LoadedModel, attention: str = "magicpig", config: MagicPIGConfig | LayerConfigs | None = None,
                dense_layers: Sequence[int] | None = None, budget: Budget | None = None,
                page_size: int = 16, mesh=None, positions: int | None = None) -> DecodeSpec:
    """The :class:`DecodeSpec` of a decode run, validated against the model.

    A layer that attends through a sliding window shorter than the run (``positions``, the
    cache's capacity; None: any length) decodes exactly over its window under every backend
    (the window bounds its cost already): it is added to the dense layers. A window at least
    as long as ``positions`` never binds, and its layers are like any other.

    Args: as :func:`decode`; ``positions``: the most positions the run's cache holds.

    Raises:
      TypeError: dense layers that are not integers.
      ValueError: unknown attention, dense layers outside ``[0, num_layers)``, a budgeted
        backend without a budget, a budget for a backend that takes none, a configuration
        the backend cannot run (e.g. a HybridConfig's heavy threshold outside 'hybrid'), or a sparse backend
        where every layer's sliding window binds (no layer would be sparse).
    """
    if attention not in BACKENDS:
        raise ValueError(f"attention must be one of {BACKENDS}, got {attention!r}")
    if budget is not None and attention not in BUDGETED:
        raise ValueError(f"budget applies to the {', '.join(BUDGETED)} backends only, got attention={attention!r}")
    if isinstance(config, LayerConfigs):  # per-layer configs (magicpig-jax calibrate) carry their dense layers
        return _layered_spec(model, attention, config, dense_layers, budget, page_size, mesh, positions)
    n_layers = model.config.num_layers
    dl = check_layer_indices("dense_layers", default_dense_layers(n_layers) if dense_layers is None else dense_layers,
                             n_layers)
    windowed = model.config.binding_windows(positions)
    if windowed and attention != "dense":
        # A sliding-window layer decodes exactly over its window (the window bounds its cost already).
        if len(windowed) == n_layers:
            raise ValueError(
                f"attention {attention!r}: every layer of this model attends through a sliding window of "
                f"{model.config.sliding_window} tokens; such layers decode exactly over their window, so a "
                "sparse method would run on no layer: use attention 'dense'")
        dl = tuple(sorted(set(dl) | set(windowed)))
    if config is None:  # the hybrid estimator's configuration carries its heavy threshold
        config = HybridConfig() if attention == "hybrid" else MagicPIGConfig()
    return DecodeSpec(backend=attention, magicpig=config, dense_layers=dl, budget=budget,
                      page_size=page_size, mesh=mesh, logit_softcap=model.config.attn_logit_softcap)


def _layered_spec(model, attention, config: LayerConfigs, dense_layers, budget, page_size, mesh,
                  positions) -> DecodeSpec:
    """The spec of per-layer configs: each sparse layer its own (K, L), their dense layers."""
    config.check_model(model.config.model_shape())
    if dense_layers is not None and check_layer_indices("dense_layers", dense_layers,
                                                        model.config.num_layers) != config.dense_layers:
        raise ValueError(f"dense_layers {tuple(dense_layers)} differ from the layer configs' dense layers "
                         f"{config.dense_layers}; leave dense_layers unset")
    sparse_windowed = sorted(set(model.config.binding_windows(positions)) - set(config.dense_layers))
    if sparse_windowed:
        raise ValueError(f"layers {sparse_windowed} attend through a sliding window of {model.config.sliding_window} "
                         "tokens and decode exactly over it: make them 'dense' in the layer configs")
    return DecodeSpec(backend=attention, magicpig=config.base(), dense_layers=config.dense_layers, budget=budget,
                      page_size=page_size, mesh=mesh, layers=config, logit_softcap=model.config.attn_logit_softcap)


def _page_size(attention: str, page_size: int | None) -> int:
    """Quest's page size, 16 tokens unless given (the Quest paper's setting); refused for the
    other backends, which would ignore it. A :class:`MagicPIGConfig` and ``dense_layers`` are taken
    by every backend (dense reads neither), so that one loop can compare backends with the same call."""
    if attention not in BACKENDS:  # decode_spec names the allowed ones
        return 16
    if page_size is not None and attention != "quest":
        raise ValueError(f"page_size applies to attention 'quest' only, got attention={attention!r}")
    return 16 if page_size is None else page_size


def decode(model: LoadedModel, state: PrefillState, *, attention: str = "magicpig",
           max_new_tokens: int = 64, config: MagicPIGConfig | LayerConfigs | None = None,
           dense_layers: Sequence[int] | None = None, sampling: Sampling | None = None,
           budget: Budget | None = None, page_size: int | None = None, stop_on_eos: bool = True,
           progress: Callable[[int], object] | None = None, mesh=None) -> tuple[list[list[int]], dict]:
    """Decode from a prefill with one attention backend (the prefill cache is not consumed).

    Args:
      model: the loaded model.
      state: a :class:`PrefillState` (its cache is copied, so it can be reused).
      attention: one of :data:`magicpig_jax.models.backends.BACKENDS`
        (``"dense"``, ``"magicpig"``, ``"magicpig-ref"``, ``"topk"``, ``"quest"``, ``"oracle"``,
        ``"hybrid"``).
      max_new_tokens: tokens to generate per row (stops earlier on EOS), ``>= 1``.
      config: MagicPIG configuration (default :class:`MagicPIGConfig()`; for ``"hybrid"``
        :class:`~magicpig_jax.attention.HybridConfig()`, heavy threshold 8); its ``num_sink`` and
        ``num_local`` also define the static set of TopK, Quest and oracle sampling. A
        :class:`~magicpig_jax.attention.LayerConfigs` gives each layer its own (K, L) or keeps it
        dense (``magicpig``, ``magicpig-ref``, ``hybrid`` only; then ``dense_layers`` stays unset).
        Dense attention reads no :class:`MagicPIGConfig` (accepted, so that one loop can compare
        backends); a :class:`~magicpig_jax.attention.LayerConfigs` with another backend is refused.
      dense_layers: layers kept dense under a sparse backend (default
        :func:`default_dense_layers`; dense attention keeps every layer dense anyway).
      sampling: :class:`Sampling` (default greedy).
      budget: keys per query head for "topk"/"quest"/"oracle" (int tokens or a
        fraction in (0, 1] of the hashed range).
      page_size: Quest's page size in tokens (default 16; refused for the other backends).
      stop_on_eos: stop a row at the model's EOS token.
      progress: optional callable ``progress(n)`` called after each step.
      mesh: optional ``("batch", "kv_heads")`` mesh from
        :func:`magicpig_jax.distributed.make_mesh`: the cache and the host indices are
        sharded over it and each device runs the host op on its own shard.

    Returns:
      ``(token_ids per row, stats dict)`` (see :class:`Generation` for the keys).

    Raises:
      ValueError: unknown attention, ``max_new_tokens < 1``, bad sampling parameters, not enough cache capacity,
        ``page_size`` outside quest, or a ``state`` whose cache an earlier decode consumed.
      TypeError: ``dense_layers`` that are not integers, a ``max_new_tokens`` that is not an int, a
        ``sampling`` that is not a :class:`Sampling`, a ``state`` that is not a :class:`PrefillState`,
        or a ``progress`` that is not callable.
      FloatingPointError: a live row's logits held NaN or ±inf (a weight, activation or cache
        value that is not finite); raised at the step that produced them.
    """
    _check_max_new_tokens(max_new_tokens)
    if sampling is not None and not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a Sampling (or None: greedy), got {type(sampling).__name__}")
    page_size = _page_size(attention, page_size)
    check_not_consumed(state)
    spec = decode_spec(model, attention, config, dense_layers, budget, page_size, mesh,
                       positions=state.cache.capacity)
    return run_decode(model, state, spec, max_new_tokens, sampling or Sampling(), stop_on_eos=stop_on_eos,
                      progress=progress)


def generate(model: LoadedModel, prompt, *, attention: str = "magicpig", max_new_tokens: int = 128,
             config: MagicPIGConfig | LayerConfigs | None = None, dense_layers: Sequence[int] | None = None,
             budget: Budget | None = None, page_size: int | None = None, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, stop: str | Sequence[str] | None = None,
             stream: bool = False,
             chat: bool = True, parse_special: bool = False,
             kv_dtype: str = "bfloat16") -> Generation | list[Generation] | Iterator[str]:
    """Generate a reply to ``prompt`` with the chosen attention.

    Args:
      model: from :func:`magicpig_jax.load_model`.
      prompt: a str (one user message), a list of messages ``{"role": "system" | "user" |
        "assistant" | "tool", "content": str}`` (a conversation), or a list of either (a batch,
        decoded together; one :class:`Generation` per row).
      attention: one of :data:`magicpig_jax.models.backends.BACKENDS`: ``"magicpig"`` (default;
        the host op on the CPU), ``"magicpig-ref"``, ``"dense"``, ``"topk"``, ``"quest"``,
        ``"oracle"``, ``"hybrid"`` (pure JAX; a :class:`~magicpig_jax.attention.HybridConfig`
        sets its heavy threshold).
      max_new_tokens: maximum tokens to generate per row, ``>= 1``; a row also stops at EOS,
        at a stop string, or where the model's context is full.
      config: :class:`MagicPIGConfig` (default K=10, L=150, 4 sinks, 64 local; for ``"hybrid"``
        a :class:`~magicpig_jax.attention.HybridConfig` with those and heavy threshold 8), or a
        :class:`~magicpig_jax.attention.LayerConfigs` (per-layer (K, L) or dense, e.g. from
        ``magicpig-jax calibrate``; :meth:`LayerConfigs.load` reads its JSON file; ``magicpig``,
        ``magicpig-ref`` and ``hybrid`` only, and its recorded model sizes must be this model's).
        Dense attention reads no :class:`MagicPIGConfig`, and ``"topk"``, ``"quest"`` and
        ``"oracle"`` read only its ``num_sink`` and ``num_local`` (their static set; the stats
        record those): accepted, so that one loop can compare backends.
      dense_layers: layers kept dense (default :func:`default_dense_layers`: layers 0 and
        ``num_layers // 2``, which on a 2-layer model are every layer, so that every backend then
        decodes densely and ``stats["sampled_fraction"]`` is None; a ``UserWarning`` says so).
      budget: keys per query head for ``"topk"``/``"quest"``/``"oracle"`` (required there, refused
        for the other backends): an int token count or a float fraction in (0, 1] of the hashed range.
      page_size: Quest's page size in tokens (default 16; refused for the other backends).
      temperature, top_p, seed: sampling (:class:`Sampling`; temperature 0 = greedy; ``seed``
        None is 0, and a seed is refused where nothing draws from it: greedy decoding with a
        backend other than ``"oracle"``). In a batch
        a sampled row depends on its position (one key per step for all rows), and a greedy
        MagicPIG row may differ from its prompt decoded alone (the batch's float32 rounding can
        change the sampled keys; see :attr:`Sampling.seed`).
      stop: a stop string or a list of them; the text is cut before the first one (one holding a
        special token's text, which decoded text leaves out, or U+FFFD, is refused).
      stream: return an iterator of text pieces as tokens are produced (one prompt only);
        a character split over several byte tokens is emitted whole.
      chat: apply the chat template (False: ``prompt`` is raw text).
      parse_special: special-token strings in the prompt become control tokens (default: they
        stay literal text, so a user message cannot forge a turn).
      kv_dtype: storage of the KV cache, ``"bfloat16"`` (default: half the bytes of float32, and
        its KL from a float32 cache is far below MagicPIG's sampling error; docs/benchmarks.md
        has the measurement) or ``"float32"``.

    Returns:
      a :class:`Generation` (one prompt), a list of them (a batch), or an iterator of str
      (``stream=True``).

    Every cache size (a batch size, a prompt length rounded up to 256 tokens plus
    ``max_new_tokens``) compiles its own programs; the prefill holds at most 4 sizes' programs and
    drops every JAX compiled program of the process when a fifth arrives, the caller's own jitted
    functions' included (:func:`magicpig_jax.memory.note_program_shape`, ``RETAINED_SHAPES``).

    Raises:
      TypeError / ValueError: a malformed prompt, a prompt longer than the model's context,
        an unknown attention, bad parameters, ``page_size`` outside quest, or ``top_p`` other than
        1 with greedy decoding (all checked before the prefill).
      FloatingPointError: a row's logits held NaN or ±inf (a weight, activation or cache value
        that is not finite); with ``stream=True``, raised by the iterator.
    """
    _check_max_new_tokens(max_new_tokens)
    sampling = Sampling(temperature=temperature, top_p=top_p, seed=0 if seed is None else seed)
    if seed is not None and sampling.temperature == 0 and attention != "oracle":
        raise ValueError(f"seed has no effect here: decoding is greedy (temperature 0) and attention {attention!r} "
                         "draws nothing (the SimHash projections' seed is MagicPIGConfig.seed)")
    # an option that would be ignored is refused, as the CLI refuses its flag (dense_layers and config are
    # accepted with attention 'dense', where they do nothing, so that one loop can compare backends)
    if sampling.temperature == 0 and sampling.top_p != 1.0:
        raise ValueError(f"top_p applies to sampling only; with temperature 0 decoding is greedy, got top_p={top_p}")
    page_size = _page_size(attention, page_size)
    # Checked before the prompt is encoded; the sliding windows against the run's length below.
    decode_spec(model, attention, config, dense_layers, budget, page_size, positions=1)
    stops = check_stop_strings(stop)
    check_stops_for(model.tokenizer, stops)
    cache_dtype = kv_cache_dtype(kv_dtype)
    prompts, batched = _prompt_batch(prompt)
    if stream and batched:
        raise ValueError("stream=True takes one prompt, not a batch")
    ids = [_encode_row(model, p, i if batched else None, chat, parse_special) for i, p in enumerate(prompts)]
    empty = [i for i, row in enumerate(ids) if not row]
    if empty:  # only a raw prompt can: the chat template always adds its turn markers
        which = f"prompt {empty[0]}" if batched else "the prompt"
        raise ValueError(f"{which} encodes to no token (an empty text with chat=False)")
    spec = decode_spec(model, attention, config, dense_layers, budget, page_size,
                       positions=cache_capacity(model, max(map(len, ids)), max_new_tokens))
    n_layers = model.config.num_layers
    if spec.backend != "dense" and not spec.sparse_layers(n_layers):  # as the CLI notes it
        how = ("the LayerConfigs keep every layer dense" if isinstance(config, LayerConfigs)
               else "choose the dense layers with dense_layers=")
        warnings.warn(f"attention={attention!r}: every layer of this {n_layers}-layer model is dense (dense layers "
                      f"{tuple(spec.dense_layers)}), so the result equals dense attention; {how}", UserWarning,
                      stacklevel=2)
    state = prefill(model, ids, max_new_tokens, cache_dtype=cache_dtype)
    decode_text = model.tokenizer.decode
    criterion = StopStrings(decode_text, stops) if stops else None
    # the prefill is not needed after this decode: decode in its cache, not in a copy of it
    run = start_decode(model, state, spec, max_new_tokens, sampling, stop=criterion, consume_prefill=True)
    if stream:
        return _stream(run, TextStream(decode_text, stops, getattr(model.tokenizer, "partial_token", None)))
    for _ in run:
        pass
    stats = {**run.stats(), "model": str(model.source), "stop": list(stops)}
    gens = [Generation(criterion.cut(decode_text(o)) if criterion else decode_text(o), o, copy.deepcopy(stats), reason)
            for o, reason in zip(run.outputs, run.stop_reasons, strict=True)]
    return gens if batched else gens[0]


def _encode_row(model, prompt, row: int | None, chat: bool, parse_special: bool) -> list[int]:
    """:func:`encode_prompt`; in a batch (``row`` given) its errors name the row."""
    try:
        return encode_prompt(model, prompt, chat, parse_special)
    except (TypeError, ValueError) as err:
        if row is None or type(err) not in (TypeError, ValueError):
            raise
        raise type(err)(f"prompt {row}: {err}") from err


def _stream(run, text: TextStream) -> Iterator[str]:
    for outputs in run:
        piece = text.push(outputs[0])
        if piece:
            yield piece
    piece = text.push(run.outputs[0], final=True)
    if piece:
        yield piece


def forward_logits(model: LoadedModel, ids: Sequence[int]) -> np.ndarray:
    """Dense causal forward of one sequence: float32 logits ``[T, V]`` at every position.

    Runs the same chunked prefill as decoding (so it tests that path).

    Raises:
      ValueError: empty ``ids``, longer than the model's context, or an id outside
        ``[0, vocab_size)``; TypeError: ``ids`` not a flat sequence of integers.
      FloatingPointError: logits that are NaN or ±inf (a weight or activation is not finite),
        naming the first such position.
    """
    if np.ndim(ids) != 1:
        raise TypeError(f"ids must be a flat sequence of token ids, got an array of {np.ndim(ids)} dimensions")
    state_ids = [list(ids)]
    if not state_ids[0]:
        raise ValueError("ids must be non-empty")
    check_token_ids("ids", state_ids[0], model.config.vocab_size)
    T = len(ids)
    if T > model.config.max_position_embeddings:
        raise ValueError(f"{T} tokens exceed the model's context of {model.config.max_position_embeddings}")
    graphdef, params = nnx.split(model.module)
    padded = np.zeros((1, _round_up(T, CHUNK)), np.int32)
    padded[0, :T] = ids
    note_program_shape((model.config, 1, padded.shape[1], "float32"))  # as the prefill: bounded programs
    cache = KVCache.zeros(model.config, 1, padded.shape[1])
    out = []
    for s in range(0, padded.shape[1], CHUNK):
        hidden, cache = prefill_chunk(graphdef, params, cache, jnp.asarray(padded[:, s:s + CHUNK]),
                                      jnp.int32(s), jnp.asarray([T], jnp.int32))
        out.append(np.asarray(hidden_to_logits(graphdef, params, hidden))[0])
    logits = np.concatenate(out)[:T]
    bad = np.nonzero(~np.isfinite(logits).all(axis=-1))[0]
    if bad.size:
        raise FloatingPointError(f"the logits at position {int(bad[0])} (of {T}) contain NaN or ±inf: a weight or "
                                 "activation is not finite")
    return logits
