"""The decode loop: a Python loop over the jitted decode step, with EOS, sampling and statistics.

:func:`run_decode` takes a built :class:`DecodeSpec`; users call
:func:`magicpig_jax.generation.decode` or :func:`magicpig_jax.generation.generate`. The loop
stays in Python because it checks EOS and stop strings and gathers statistics on the host,
and evaluation feeds tokens and reads logits through :class:`DecodeHooks`
(:func:`magicpig_jax.eval.forcing.forced_decode`). Each program call runs a chunk of steps
(a ``lax.fori_loop`` of up to ``CHUNK_MAX``), and the next chunk is enqueued before the
current one is read back: see :class:`DecodeRun`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from magicpig_jax.memory import LRUCache, compile_then_trim, trim_heap
from magicpig_jax.models.backends import DecodeSpec, backend_for
from magicpig_jax.models.cache import KVCache
from magicpig_jax.models.decoding import (
    build_indices,
    check_capacity,
    check_token_ids,
    compiled_decode_step,
    sample_token,
)

__all__ = ["Sampling", "DecodeHooks", "DecodeRun", "start_decode", "run_decode", "position_limit"]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen.

    Attributes:
      temperature: ``>= 0``; 0 is greedy (argmax, the lowest id among ties), and so is one below
        float32's smallest normal number (about 1.2e-38: the step runs in float32, flushing subnormals).
      top_p: nucleus mass in ``(0, 1]`` (Holtzman et al. 2020); 1 keeps the whole vocabulary.
      seed: seed of the sampling key, an int in ``[0, 2**32)`` (``jax.random.key`` keeps 32 bits:
        a larger seed would repeat a smaller one); not the SimHash projections: those use
        :attr:`MagicPIGConfig.seed`. One key per step serves the whole batch, so a sampled row's
        tokens (and oracle attention's draws, greedy included) depend on its position in the
        batch: the rows are not the prompts decoded alone with this seed. Greedy decoding with
        the other methods gives each row its tokens alone up to float32 rounding: a decode step's
        products run over the whole batch, and their summation order can differ with the batch's
        size and rows (logits a few 1e-5 apart), which can flip a near-tie of the argmax and, under
        MagicPIG, which keys a query's SimHash codes select, so a MagicPIG row can diverge from
        its prompt decoded alone. The prefill does not depend on the other rows.

    Raises:
      ValueError: a value out of range, naming the field.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        def real(x) -> bool:  # Python or NumPy int / float, not bool
            return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool | np.bool_)

        if not (real(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got temperature={self.temperature!r}")
        if not (real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got top_p={self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int | np.integer) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an int in [0, 2**32), got seed={self.seed!r}")
        # NumPy scalars are kept as Python numbers (the run's stats are written as JSON)
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "seed", int(self.seed))


@dataclasses.dataclass(frozen=True)
class DecodeHooks:
    """Evaluation hooks of the decode loop (see :func:`magicpig_jax.eval.forcing.forced_decode`).

    Attributes:
      forced_tokens: B lists of at least ``max_new_tokens`` ids fed instead of the sampled ones
        (integers in ``[0, vocab_size)``: :func:`start_decode` refuses others).
      on_logits: ``callback(step, logits)`` with the float32 ``[B, V]`` NumPy logits that
        predict token ``step`` (step 0 = the prefill's).
      then_sample: the forced ids are a prefix: a row's list may be shorter than
        ``max_new_tokens``, the tokens after it are sampled, and EOS / stop checks apply only
        to the sampled tokens (a question decoded after a prefilled document, then its answer).
    """

    forced_tokens: Sequence[Sequence[int]] | None = None
    on_logits: Callable[[int, np.ndarray], None] | None = None
    then_sample: bool = False


StopFn = Callable[[int, list[int]], bool]  # (row, its ids so far) -> stop this row now


def check_not_consumed(state) -> None:
    """Refuse a :class:`~magicpig_jax.generation.PrefillState` whose cache a decode consumed.

    Raises:
      ValueError: ``state.cache`` is ``None`` (an earlier decode ran with ``consume_prefill=True``).
      TypeError: ``state`` is not a prefill state.
    """
    if not all(hasattr(state, a) for a in ("cache", "prompt_lengths", "last_logits")):
        raise TypeError(f"state must be a PrefillState (magicpig_jax.generation.prefill), got {type(state).__name__}")
    if state.cache is None:
        raise ValueError("this PrefillState's cache was consumed by an earlier decode (consume_prefill=True): "
                         "prefill again, or decode with consume_prefill=False while the state is still needed")


def start_decode(model, state, spec: DecodeSpec, max_new_tokens: int, sampling: Sampling, *,
                 stop_on_eos: bool = True, stop: StopFn | None = None, progress=None,
                 hooks: DecodeHooks | None = None, consume_prefill: bool = False) -> DecodeRun:
    """Build the decode state of a prefill and return the run, ready to iterate.

    Args:
      model, state: the loaded model and a :class:`~magicpig_jax.generation.PrefillState`.
      spec: the :class:`DecodeSpec`.
      max_new_tokens: tokens per row, ``>= 1``.
      sampling: the :class:`Sampling`.
      stop_on_eos: stop a row at any of the model's end-of-sequence / end-of-turn ids.
      stop: optional ``stop(row, ids) -> bool`` checked after each new token of a live row
        (stop strings); a row it stops reports ``"stop"``.
      progress: optional ``progress(n)`` called after each step.
      hooks: evaluation hooks (:func:`magicpig_jax.eval.forcing.forced_decode`).
      consume_prefill: decode in the prefill's own cache instead of a copy of it (one cache
        less in memory: the copy is as large as the cache). ``state`` cannot be decoded again
        afterwards (its ``cache`` becomes None). For the last decode of a prefill.

    Raises:
      ValueError: ``max_new_tokens < 1``, bad forced tokens, not enough cache capacity, a
        ``state`` whose cache an earlier decode consumed, ``consume_prefill`` with a state that
        shares its cache (:func:`~magicpig_jax.generation.prefill_with_prefixes`), or rows / KV
        heads that the spec's mesh does not divide.
      TypeError: a forced token id that is not an integer, a ``state`` that is not a prefill state,
        or a ``progress`` that is not callable.
    """
    hooks = hooks or DecodeHooks()
    check_not_consumed(state)
    if progress is not None and not callable(progress):  # it failed after the first step
        raise TypeError(f"progress must be callable (progress(n) after each step) or None, got {progress!r}")
    B = len(state.prompt_lengths)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if spec.mesh is not None:  # the rows and KV heads split over the mesh's axes: a clear error, not JAX's
        from magicpig_jax import distributed as dist

        dist.check_split(spec.mesh, B, model.config.num_kv_heads)
    if hooks.forced_tokens is not None and (len(hooks.forced_tokens) != B or (not hooks.then_sample and any(
            len(f) < max_new_tokens for f in hooks.forced_tokens))):
        raise ValueError("forced_tokens needs one list of at least max_new_tokens ids per row")
    for b, forced in enumerate(hooks.forced_tokens or ()):
        check_token_ids(f"forced_tokens[{b}]", forced, model.config.vocab_size)
    # A row stops at max_new_tokens or where its next token would need a position past the
    # context: token i is predicted at position prompt_length + i - 1.
    max_positions, limit_name = position_limit(model, state)
    # (in int64: a max_new_tokens past int32, which the context clips anyway, must not overflow)
    limits = np.minimum(np.int64(min(max_new_tokens, np.iinfo(np.int64).max)),
                        np.asarray(max_positions, np.int64) - state.prompt_lengths + 1)
    if consume_prefill and state.shares_cache:
        raise ValueError("this PrefillState shares its cache buffers with another (prefill_with_prefixes): "
                         "consuming it would delete the other's; decode it with consume_prefill=False")
    cache = _decode_cache(state, spec, limits, consume_prefill)
    n_layers = model.config.num_layers
    graphdef, params = nnx.split(model.module)
    leaves, treedef = jax.tree.flatten(params)
    step = compiled_decode_step(graphdef, treedef, spec)
    # Compile the step before the index exists (memory.compile_then_trim).
    # Not for a backend with its own step (offload) or a sharded cache: their programs take
    # placements that the shapes alone do not give.
    ahead = backend_for(spec).make_step is None and spec.mesh is None
    compile_seconds = 0.0
    if ahead:
        t0 = time.perf_counter()
        build = functools.partial(build_indices, spec=spec, num_layers=n_layers)
        dims = (len(spec.sparse_layers(n_layers)), model.config.num_heads, model.config.vocab_size)
        # Evaluation hooks feed or read every step on the host: one step per call.
        chunks = hooks.forced_tokens is None and hooks.on_logits is None and max_new_tokens >= CHUNK_MIN_TOKENS
        step = _step_compiled_ahead(step, leaves, cache, build, B, sampling, dims, CHUNK_MAX if chunks else 1)
        compile_seconds = time.perf_counter() - t0
    else:
        step = _single_step_chunk(step, spec.mesh)
    t0 = time.perf_counter()
    indices = build_indices(cache, spec, n_layers)
    jax.block_until_ready(indices)
    trim_heap()  # the build's freed working memory
    sparse = spec.sparse_layers(n_layers)
    cache, indices = backend_for(spec).prepare(spec, cache, indices)
    if spec.mesh is not None:
        from magicpig_jax import distributed as dist

        # The step's outputs carry the short form of each spec: its first inputs must too, or
        # the step compiles twice (distributed.canonical_placement).
        cache, indices = dist.canonical_placement(spec.mesh, (cache, indices))
    index_seconds = time.perf_counter() - t0 if sparse else None
    run = DecodeRun(model, spec, sampling, hooks, state, cache, indices, limits, stop_on_eos, stop, progress,
                    step=(leaves, step, compile_seconds))
    run.index_seconds, run.max_new_tokens, run.max_positions = index_seconds, max_new_tokens, int(max_positions)
    for b in np.nonzero(limits < max_new_tokens)[0]:
        run.stop_reasons[b] = limit_name
    return run


def run_decode(model, state, spec: DecodeSpec, max_new_tokens: int, sampling: Sampling, *,
               stop_on_eos: bool = True, stop: StopFn | None = None, progress=None,
               hooks: DecodeHooks | None = None) -> tuple[list[list[int]], dict]:
    """Decode to the end: ``(token ids per row, stats)`` (see :func:`start_decode` for the arguments)."""
    run = start_decode(model, state, spec, max_new_tokens, sampling, stop_on_eos=stop_on_eos, stop=stop,
                       progress=progress, hooks=hooks)
    for _ in run:
        pass
    return run.outputs, run.stats()


def _decode_cache(state, spec: DecodeSpec, limits: np.ndarray, consume: bool) -> KVCache:
    """The decode's cache (sharded over ``spec.mesh`` if any), checked for capacity.

    ``limits``: int ``[B]``, the tokens each row may decode (``max_new_tokens``, or fewer where
    the context ends first). A copy of the prefill cache, whose buffers the steps then update in
    place (donated); with ``consume`` the prefill's own buffers, and ``state.cache`` becomes None.
    """
    need = int((state.prompt_lengths + limits).max())
    if need > state.cache.capacity:
        raise ValueError(f"the prompt and the new tokens need {need} positions, more than the cache's capacity "
                         f"{state.cache.capacity}: prefill with at least this max_new_tokens")
    cache = state.cache if consume and isinstance(state.cache, KVCache) else state.cache.copy()
    if consume:
        state.cache = None
    if spec.mesh is not None:
        from magicpig_jax import distributed as dist

        mesh = spec.mesh
        cache = jax.tree.map(lambda x: dist.shard_kv(mesh, x) if x.ndim == 4 else dist.shard_rows(mesh, x), cache)
    return cache


# (step, index tree) -> the step jitted over the index's leaves; least recently used evicted
# first, as large as the step cache (models/decoding.py), so that an evaluation cycling its
# methods per document finds each one's program again (memory.compile_then_trim keys by it).
_FLAT_STEPS = LRUCache()
_FLAT_STEPS_SIZE = 64


# Steps one program call may run (the chunk's output buffers are this long), and the wall time
# a chunk aims at once the step time is known. A call costs the host about as much as a small
# step's work (argument handling for every parameter, cache and index buffer), so short steps
# are run several to a call; longer ones gain nothing from it, and a chunk's tokens reach the
# caller (streaming, stop checks) only when it ends.
CHUNK_MAX = 8
CHUNK_SECONDS = 0.1
# Shorter runs compile the one-step program: chunks start only once a step has been timed (the
# fourth call), and the loop's program takes more memory to compile.
CHUNK_MIN_TOKENS = 32


def _step_compiled_ahead(step, leaves, cache, build, B: int, sampling: Sampling, dims: tuple[int, int, int],
                         max_count: int):
    """A chunk step (see :class:`DecodeRun`) over ``step`` (from :func:`compiled_decode_step`),
    compiled now, before ``build(cache)`` runs.

    With ``max_count > 1`` the chunk runs ``count <= max_count`` steps in one program
    (``lax.fori_loop``; ``count`` is an argument, so one program serves every chunk length);
    with 1, the program is the step itself. The index exists only as shapes
    (``jax.eval_shape``); the program is compiled over its leaves, so no index object is ever
    made of shapes (a type-checked index such as ``LSHIndex`` accepts arrays only).
    ``dims = (S, Hq, V)``: sparse layers, query heads and vocabulary of the step's outputs.
    """
    box = {}

    def index_leaves(c):
        flat, box["tree"] = jax.tree.flatten(build(c))
        return flat

    shapes = jax.eval_shape(index_leaves, cache)
    tree = box["tree"]
    key = (step.jitted, tree, dims, max_count)
    flat = _FLAT_STEPS.get(key)
    if flat is None:
        inner = step.jitted
        S, Hq, V = dims

        def flat_chunk(leaves, cache, index_leaves, tokens, base_key, t, count, temperature, top_p):
            Bt = tokens.shape[0]
            if max_count == 1:
                tok, logits, ns, cache, indices = inner(leaves, cache, jax.tree.unflatten(tree, index_leaves), tokens,
                                                        base_key, t, temperature, top_p)
                return tok, tok[None], logits, ns[None], cache, jax.tree.leaves(indices)

            def body(i, carry):
                cache, indices, tok, toks, nss, _ = carry
                tok, logits, ns, cache, indices = inner(leaves, cache, indices, tok, base_key, t + i, temperature,
                                                        top_p)
                return cache, indices, tok, toks.at[i].set(tok), nss.at[i].set(ns), logits

            init = (cache, jax.tree.unflatten(tree, index_leaves), tokens, jnp.zeros((max_count, Bt), jnp.int32),
                    jnp.zeros((max_count, S, Bt, Hq), jnp.int32), jnp.zeros((Bt, V), jnp.float32))
            cache, indices, tok, toks, nss, logits = jax.lax.fori_loop(0, count, body, init)
            return tok, toks, logits, nss, cache, jax.tree.leaves(indices)

        flat = jax.jit(flat_chunk, donate_argnums=(1, 2))
        _FLAT_STEPS.put(key, flat, _FLAT_STEPS_SIZE)
    compiled = compile_then_trim(flat, leaves, cache, shapes, jax.ShapeDtypeStruct((B,), jnp.int32),
                                 jax.random.key(sampling.seed), np.int32(1), np.int32(1),
                                 jnp.float32(sampling.temperature), jnp.float32(sampling.top_p))

    def chunk(leaves, cache, indices, tokens, base_key, t, count, temperature, top_p, host_lengths):
        # every row needs `count` free positions: ValueError before anything is written
        check_capacity(cache, np.asarray(host_lengths) + (count - 1))
        tok, toks, logits, nss, cache, flat_indices = compiled(leaves, cache, jax.tree.leaves(indices), tokens,
                                                               base_key, np.int32(t), np.int32(count), temperature,
                                                               top_p)
        return tok, toks, logits, nss, cache, jax.tree.unflatten(tree, flat_indices)

    chunk.max_count = max_count
    return chunk


def _single_step_chunk(step, mesh=None):
    """A chunk step of one decode step (a backend with its own step, a sharded cache).

    With a ``mesh`` the tokens are placed over its ``batch`` axis, as the step's own output
    tokens are, so that the first call (tokens from the prefill's logits) and the later ones
    share one compiled program.
    """
    if mesh is not None:
        from magicpig_jax import distributed as dist

    def chunk(leaves, cache, indices, tokens, base_key, t, count, temperature, top_p, host_lengths):
        if count != 1:
            raise ValueError(f"this decode step runs one step per call, got count={count}")
        if mesh is not None:
            tokens = dist.shard_rows(mesh, tokens)
        tok, logits, ns, cache, indices = step(leaves, cache, indices, tokens, base_key, np.int32(t), temperature,
                                               top_p, host_lengths=host_lengths)
        return tok, tok[None], logits, ns[None], cache, indices

    chunk.max_count = 1
    return chunk


# Jitted once: sampling the first token eagerly would retrace lax.cond's branches every call.
_sample_token_jit = jax.jit(sample_token)


def position_limit(model, state) -> tuple[int, str]:
    """The number of positions a row may fill, and the name of what sets it: the model's context
    (``max_position_embeddings``, "context"), or the cache capacity when the prefill allowed
    positions past the context (timing experiments)."""
    if state.allow_beyond_context:
        return state.cache.capacity, "context"
    return int(model.config.max_position_embeddings), "context"


class DecodeRun:
    """One decode run: iterate it to decode; each iteration yields the ids of every row so far.

    The Python loop over the jitted step keeps EOS, stop criteria, hooks and statistics on
    the host. ``outputs``, ``stop_reasons`` and :meth:`stats` are valid at any point (also
    after an interruption). A run is iterated once: its cache has moved past the prefill, so a
    second ``for`` loop over it (to continue after a ``break``, or after it finished) raises
    ``RuntimeError`` instead of decoding from the prefill's logits again into the moved cache;
    keep the first iterator to continue, or start a new run from the prefill.

    Steps run in chunks: one program call runs ``count`` steps (1 until a step has been
    timed, then as many as fit in ``CHUNK_SECONDS``, at most ``CHUNK_MAX``; always 1 with
    evaluation hooks or a backend with its own step), because on a CPU a call costs the host
    about as much as a small model's step. The next chunk is enqueued before the current one
    is read back, so the host's work overlaps the steps. After a run that stopped early (EOS,
    a stop string) the cache and the index also hold the positions of the steps it ran past
    the stop; their tokens are not in ``outputs``.
    """

    def __init__(self, model, spec: DecodeSpec, sampling: Sampling, hooks: DecodeHooks, state, cache, indices,
                 limits: np.ndarray, stop_on_eos: bool, stop: StopFn | None, progress, step=None):
        self.model, self.spec, self.sampling, self.hooks, self.state = model, spec, sampling, hooks, state
        self.cache, self.indices, self.limits = cache, indices, limits
        self.stop_on_eos, self.stop, self.progress = stop_on_eos, stop, progress
        self.B = len(limits)
        # the positions each row may fill (its prompt and its own limit; at most the cache's capacity)
        self._needed = np.asarray(state.prompt_lengths) + np.asarray(limits)
        self.compile_seconds = 0.0
        if step is None:  # (parameter leaves, step, seconds already spent compiling it)
            graphdef, params = nnx.split(model.module)
            leaves, treedef = jax.tree.flatten(params)
            step = (leaves, _single_step_chunk(compiled_decode_step(graphdef, treedef, spec), spec.mesh), 0.0)
        self.leaves, self.step, self._compiled_seconds = step
        self.base_key = jax.random.key(sampling.seed)
        self.eos = set(model.tokenizer.eos_token_ids) | set(model.config.eos_token_ids)
        self.frac_sum = np.zeros(len(spec.sparse_layers(model.config.num_layers)))
        self.frac_steps = self.steps = 0
        self.seconds = 0.0
        self.index_seconds: float | None = None
        self.max_positions: int | None = None  # the positions a row may fill (start_decode sets it)
        self._iterated = False  # __iter__ runs once (the cache moves on)
        self.max_new_tokens = int(limits.max()) if len(limits) else 0
        self.stop_reasons: list[str] = ["length"] * self.B
        self.outputs: list[list[int]] = [[] for _ in range(self.B)]

    def _forced(self, t: int, tokens) -> jax.Array:
        """Token ``t`` of each row: the forced id where there is one, else the sampled ``tokens[b]``."""
        forced = self.hooks.forced_tokens
        if not self.hooks.then_sample:
            return jnp.asarray([f[t] for f in forced], jnp.int32)
        if all(t >= len(f) for f in forced):
            return tokens
        sampled = np.asarray(tokens)
        return jnp.asarray([f[t] if t < len(f) else sampled[b] for b, f in enumerate(forced)], jnp.int32)

    def _first(self, last_logits) -> jax.Array:
        sampled = self._sampled_first(last_logits)
        self._check_logits(0, sampled, np.zeros(self.B, bool))
        if self.hooks.forced_tokens is not None:
            return self._forced(0, sampled if self.hooks.then_sample else None)
        return sampled

    def _sampled_first(self, last_logits) -> jax.Array:
        # the greedy case too: sample_token's lax.cond takes its argmax, and marks NaN rows -1
        return _sample_token_jit(last_logits, jax.random.fold_in(self.base_key, 0),
                                 jnp.float32(self.sampling.temperature), jnp.float32(self.sampling.top_p))

    def _check_logits(self, t: int, sampled: np.ndarray, done: np.ndarray) -> None:
        """Raise if a live row's logits for token ``t`` held NaN or ±inf (``sample_token`` gave -1).

        Teacher-forced runs too: their logits would give a NaN likelihood, which the evaluation's
        means would drop."""
        bad = np.nonzero((np.asarray(sampled) < 0) & ~done)[0]
        if len(bad):
            raise FloatingPointError(
                f"the logits for new token {t} of row(s) {bad.tolist()} contain NaN or ±inf "
                f"({self.spec.backend} attention): a weight, activation or KV-cache value is not finite")

    def _take(self, tok: np.ndarray, done: np.ndarray) -> None:
        """Append each live row's new token and mark the rows that stop."""
        for b in np.nonzero(~done)[0]:
            ids = self.outputs[b]
            ids.append(int(tok[b]))
            if self.hooks.then_sample and len(ids) <= len(self.hooks.forced_tokens[b]):
                pass  # a forced id: no EOS or stop check
            elif self.stop_on_eos and ids[-1] in self.eos:
                self.stop_reasons[b], done[b] = "eos", True
            elif self.stop is not None and self.stop(int(b), ids):
                self.stop_reasons[b], done[b] = "stop", True
            elif len(ids) >= self.limits[b]:
                done[b] = True

    def _count(self, t: int) -> int:
        """Steps of the next chunk, which predicts tokens ``t + 1 ..``: one until a step is timed."""
        if self.step.max_count == 1 or self.hooks.forced_tokens is not None or self.hooks.on_logits is not None:
            return 1  # the hooks feed or read every step on the host
        n = 1
        if self.steps >= 2 and self.seconds > 0:
            n = int(CHUNK_SECONDS / (self.seconds / (self.steps - 1)))
        return max(1, min(n, self.step.max_count, self._last - t))

    def _dispatch(self, t: int, tokens):
        """Enqueue the chunk of steps that predicts tokens ``t + 1 ..`` from token ``t`` (``tokens``, on the device).

        Reads nothing a running step produces: the capacity check and the context lengths use
        the lengths tracked on the host, so the call returns while the previous chunk still runs.
        Returns ``(t, count, outputs, context lengths before the chunk)``.
        """
        count = self._count(t)
        before = self._lengths
        # Every row takes every step. A row past its own limit (stopped by the context while others
        # decode on) needs no more positions: once full, its steps write nothing (decode_step), and its
        # tokens are never read. So the capacity check sees it at most at its limit.
        checked = np.minimum(before, self._needed - count)
        tok, toks, logits, nss, self.cache, self.indices = self.step(
            self.leaves, self.cache, self.indices, tokens, self.base_key, t + 1, count, self._temp, self._top_p,
            checked)
        self._lengths = np.minimum(before + count, self.cache.capacity)  # the step's own rule (decode_step)
        return t, count, (tok, toks, logits, nss), before

    def _book(self, t: int, logits, ns, ctx, live: np.ndarray, now: float) -> None:
        """Book the step that predicted token ``t`` (read): hooks, timing, sampled fractions.

        ``ns``: int ``[S, B, Hq]`` keys it sampled; ``ctx``: int ``[B]``, the keys each row had;
        ``live``: the rows still decoding when it ran.
        """
        if self.hooks.on_logits is not None:
            self.hooks.on_logits(t, np.asarray(logits))
        self.steps += 1
        if self.steps == 1:  # the first step compiles (unless compiled ahead); time the rest
            self.compile_seconds = self._compiled_seconds + now - self._t0
            self._t0 = now
        if len(self.frac_sum):
            self.frac_sum += (ns / ctx[None, :, None]).mean(axis=2)[:, live].mean(axis=1)
            self.frac_steps += 1
        if self.progress is not None:
            self.progress(1)
        self.seconds = now - self._t0

    def __iter__(self):
        if self._iterated:
            raise RuntimeError("this DecodeRun was already iterated (its cache has moved past the prefill): "
                               "keep its first iterator to continue, or start_decode again from the prefill")
        self._iterated = True
        hooks = self.hooks
        if hooks.on_logits is not None:
            hooks.on_logits(0, np.asarray(self.state.last_logits))
        self._temp, self._top_p = jnp.float32(self.sampling.temperature), jnp.float32(self.sampling.top_p)
        done = np.zeros(self.B, bool)
        self._lengths = np.asarray(self.cache.lengths).copy()
        self._last = int(self.limits.max()) - 1  # the last token index any row may reach
        tokens = self._first(self.state.last_logits)
        # The next chunk is enqueued before the current one is read back (JAX runs it
        # asynchronously), so the host's bookkeeping and the next call overlap the running
        # steps instead of following them. A run that then stops (EOS, a stop string) has run
        # steps it did not need: their tokens are never read, and the cache and the index hold
        # those positions too. Forced prefixes followed by sampling (``then_sample``) need each
        # sampled token on the host first: one step at a time, no overlap.
        ahead = not (hooks.forced_tokens is not None and hooks.then_sample)
        self._t0 = time.perf_counter()
        tok = np.asarray(tokens)  # token 0, from the prefill's logits
        self._take(tok, done)
        yield self.outputs
        if done.all() or self._last < 1:
            return
        cur = self._dispatch(0, tokens)
        while True:
            t, count, (last_tok, toks, logits, nss), before = cur
            nxt = None
            if ahead and t + count < self._last:
                nxt = self._dispatch(t + count, self._next_input(t + count, last_tok))
            toks = np.asarray(toks)[:count]  # waits for the chunk
            now = time.perf_counter()
            ns = np.asarray(nss, np.float64)[:count] if len(self.frac_sum) else None
            for i in range(count):
                self._check_logits(t + 1 + i, toks[i], done)
                self._book(t + 1 + i, logits, None if ns is None else ns[i], before + 1 + i, ~done, now)
                tk = toks[i] if hooks.forced_tokens is None else np.asarray(self._forced(t + 1 + i, toks[i]))
                self._take(tk, done)
                yield self.outputs
                if done.all():
                    return
            if nxt is None:
                if t + count >= self._last:
                    return
                nxt = self._dispatch(t + count, self._next_input(t + count, last_tok))
            cur = nxt

    def _next_input(self, t: int, sampled):
        """Token ``t`` as the next chunk's input: the forced id where there is one, else ``sampled``."""
        return self._forced(t, sampled) if self.hooks.forced_tokens is not None else sampled

    def stats(self) -> dict:
        """What was asked and what was measured (see :class:`~magicpig_jax.generation.Generation`)."""
        spec, n_layers = self.spec, self.model.config.num_layers
        sparse = spec.sparse_layers(n_layers)
        per_layer = ({int(layer): float(f / self.frac_steps) for layer, f in zip(sparse, self.frac_sum, strict=True)}
                     if self.frac_steps else {})
        steps, seconds = self.steps, self.seconds
        dense = spec.backend == "dense"
        return {
            "attention": spec.backend,
            "attention_runs_on": backend_for(spec).name,
            "magicpig": _config_used(spec),
            "layer_configs": None if spec.layers is None else spec.layers.to_json(),
            "budget": spec.budget,
            "dense_layers": list(range(n_layers)) if dense else list(spec.dense_layers),
            "sampling": dataclasses.asdict(self.sampling),
            "max_new_tokens": self.max_new_tokens,
            "prompt_tokens": [int(x) for x in self.state.prompt_lengths],
            "prefill_seconds": self.state.seconds,
            "decode_tokens": sum(len(o) for o in self.outputs),
            "decode_steps": steps,
            "decode_seconds": seconds,
            # None (JSON null) when undefined: fewer than two steps.
            "decode_tokens_per_s": ((steps - 1) * self.B / seconds) if seconds > 0 and steps > 1 else None,
            "compile_seconds": self.compile_seconds,
            "index_build_seconds": self.index_seconds,
            "stop_reasons": list(self.stop_reasons),
            "sampled_fraction_per_layer": per_layer,
            "sampled_fraction": float(np.mean(list(per_layer.values()))) if per_layer else None,
        }


def _config_used(spec) -> dict | None:
    """The fields of ``spec.magicpig`` the backend reads: all of them for MagicPIG, the static set
    (and the seed of oracle sampling) for TopK / Quest / oracle, none for dense or per-layer configs."""
    if spec.backend == "dense" or spec.layers is not None:
        return None
    fields = dataclasses.asdict(spec.magicpig)
    if spec.backend in ("magicpig", "magicpig-ref", "hybrid"):
        return fields
    keep = ("num_sink", "num_local") + (("seed",) if spec.backend == "oracle" else ())
    return {k: fields[k] for k in keep}
