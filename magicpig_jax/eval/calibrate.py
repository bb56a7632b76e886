"""``magicpig-jax calibrate``: per layer MagicPIG's (K, L) or dense, meeting a KL budget at the least measured cost.

The paper hand-picks one (K, L) for every layer and keeps two layers dense (arXiv 2410.16179,
Section 5). Layers differ: some heads are flat, some concentrated, and the cost of a layer's
attention depends on its tables. This command calibrates a :class:`~magicpig_jax.attention.LayerConfigs`
on a text that is *not* an evaluation text (default: the bundled LGPL-2.1, which the
``licenses-heldout`` and ``jargon`` haystacks do not contain; ``magicpig-jax eval`` refuses a
file whose calibration text overlaps its haystack):

1. **Dense reference.** The text's first ``--length`` tokens are prefilled densely; the last
   ``--forced-tokens`` of them are teacher-forced with dense attention, giving the reference
   next-token distributions.
2. **Per-layer measurements.** For every layer ``l`` and candidate ``c`` of ``--candidates``
   (plus dense): the attention error ``e(l, c)``, the mean over ``--probes`` decode positions and
   the heads of ``||o_c - o||^2 / ||o||^2`` (the pure-JAX estimator with the decoder's
   projections for that layer, against dense attention), and the measured cost ``ms(l, c)``: the
   median over ``--repeats`` rounds of one call of that layer's attention in the host op
   (``host_magicpig_attention``; dense: ``host_exact_attention``), and the bytes its attention
   reads (:func:`magicpig_jax.eval.cost.step_bytes`). Each round times every choice of the layer
   once, in a rotated order, so that the machine's drift falls on all of them alike; before each
   call the caches are flushed (:data:`FLUSH_BYTES` written), because in a decode step a layer's
   cache and index were evicted by the other layers since its last call, and repeated calls on a
   cache that fits in the last-level cache would time a dense layer at cache speed. The cost a
   choice is given is a line ``ms = a + b * bytes`` fitted per choice across the layers
   (:func:`pool_ms`): every layer has the same attention shape, so the layers differ only in the
   rows and buckets a choice reads, and a layer's own median followed the machine's noise.
   ``--cost`` picks what is minimized: ``ms`` (the default, that fit), ``ms-per-layer`` (each
   layer's own median, the rule before 2026-12-04) or ``bytes`` (which does not drift on a
   shared machine).
3. **Candidates.** For each ``λ`` at which some layer's choice changes (and one between each
   two), every layer takes ``argmin_c cost(l, c) + λ e(l, c)`` (the cost ``--cost`` names; the
   error is squared, as a KL is to first order quadratic in a small perturbation of the logits);
   the distinct assignments are ordered by their total cost.
4. **Measured KL.** A binary search over that order (at most ``--max-evals`` teacher-forced
   decodes with the per-layer configs) finds the cheapest assignment whose mean KL(dense ||
   method) over the forced tokens is ``<= --kl-budget``; all-dense (KL 0) is the fallback.

The result is a small JSON file (:meth:`LayerConfigs.save`) with the per-layer choices and what was
measured (per-layer ms and error, every assignment tried with its cost and KL, the text's hash and
paragraph hashes), which ``magicpig-jax generate/eval --magicpig-config FILE`` and
``generate(..., config=LayerConfigs.load(FILE))`` use.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from magicpig_jax.argparsing import Parser, path_arg
from magicpig_jax.eval.corpus import CALIBRATION_TEXT

__all__ = ["main", "make_parser", "calibrate", "measure_layers", "assignments", "to_layer_configs",
           "paragraph_hashes", "check_config_for_eval", "other_model_note", "recorded_identities", "pool_ms",
           "DEFAULT_TEXT", "DEFAULT_CANDIDATES", "COST_KINDS", "check_calibration_args"]

DEFAULT_TEXT = CALIBRATION_TEXT  # held out of the default evaluation haystack
DEFAULT_CANDIDATES = "8x75,9x120,10x150,11x300,12x600"
DENSE = "dense"
COST_KINDS = ("ms", "ms-per-layer", "bytes")
# Bytes written before each timed call: more than the last-level cache of the CPUs we run on (32 MiB on
# the 2-core CI VM), so that a layer's K, V and index are read from memory, as in a decode step.
FLUSH_BYTES = 128 << 20


def paragraph_hashes(source: str) -> list[str]:
    """12-hex-digit SHA-1 of each paragraph of a text file, split as the eval haystacks are
    (:func:`magicpig_jax.eval.corpus.load_prose`)."""
    from magicpig_jax.eval.corpus import load_prose

    return [hashlib.sha1(p.encode()).hexdigest()[:12] for p in load_prose(Path(source))]


# Runs of this many words are compared, whatever the line breaks: calibrate records the text's
# consecutive, non-overlapping runs of SHINGLE_WORDS, and eval hashes every run of the haystack (one
# per start word). A text is refused when SHARED_RUNS consecutive runs of it are all in the haystack,
# which any shared passage of (SHARED_RUNS + 1) * SHINGLE_WORDS - 1 = 203 words or more holds, wherever it
# starts (one of 192 words, if it starts on the text's grid of runs), reflowed or not. Shorter shared
# stretches are boilerplate that related texts have in common: the bundled LGPL-2.1 (the default
# calibration text) shares runs of up to 6 with the GPL and other licenses of licenses-heldout.
SHINGLE_WORDS = 12
SHARED_RUNS = 16


def shingle_hashes(words: list[str], disjoint: bool = False) -> list[str]:
    """12-hex-digit SHA-1 of runs of :data:`SHINGLE_WORDS` words joined by one space: every run (one
    per start word), or with ``disjoint`` the non-overlapping ones (from word 0, in steps of
    SHINGLE_WORDS). Words are whitespace-separated, so reflowing a text changes none."""
    step = SHINGLE_WORDS if disjoint else 1
    return [hashlib.sha1(" ".join(words[i:i + SHINGLE_WORDS]).encode()).hexdigest()[:12]
            for i in range(0, len(words) - SHINGLE_WORDS + 1, step)]


@functools.cache
def _haystack_shingles(haystack: str) -> frozenset[str]:
    from magicpig_jax.eval.corpus import load_prose

    return frozenset(shingle_hashes(" ".join(load_prose(haystack)).split()))


def _identities(source) -> tuple[str | None, str | None]:
    """``(weights identity, recorded source identity)`` of a model path
    (:func:`magicpig_jax.io.digest.weights_identity`; a checkpoint's ``source_sha1``); None for a
    model held only in memory (no files) or a checkpoint that records no source."""
    from magicpig_jax.io.checkpoint import recorded_source
    from magicpig_jax.io.digest import weights_identity

    try:
        return weights_identity(source), recorded_source(source)
    except (OSError, ValueError, TypeError):
        return None, None


def recorded_identities(path: str | Path) -> list[str]:
    """The model identities a calibrated file records (``calibration.weights_id`` and
    ``source_weights_id``; none for a file written by hand). Cheap: called before a model loads.

    Raises:
      ValueError: one that is not a string (naming the file and the key).
    """
    record = json.loads(Path(path).read_text()).get("calibration", {})
    if not isinstance(record, dict):
        return []
    recorded = []
    for key in ("weights_id", "source_weights_id"):
        value = record.get(key)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{path}: 'calibration.{key}' must be a string (the calibrated model's identity), "
                             f"got {value!r}")
        if value is not None:
            recorded.append(value)
    return recorded


def other_model_note(path: str | Path, model_source) -> str | None:
    """A note when the calibrated file at ``path`` was measured on another model than ``model_source``.

    ``magicpig-jax calibrate`` records the model's weights identity (``calibration.weights_id``:
    :func:`magicpig_jax.io.digest.weights_identity`, which only the weights change) and, for a
    converted checkpoint, the identity of the model it was converted from
    (``calibration.source_weights_id``); the sizes check (``model_shape``) accepts any model of the same
    sizes. A file applied to another model still decodes as it says, but the KL budget it met was
    measured on the first one. The model and its converted checkpoints count as one. None when they
    match, or the file (written by hand or before the identity was recorded) or the model (held in
    memory) has none.

    Raises:
      ValueError: ``calibration.weights_id`` or ``calibration.source_weights_id`` is not a string
        (naming the file).
    """
    recorded = recorded_identities(path)
    mine = [x for x in _identities(model_source) if x is not None]
    if not recorded or not mine or set(recorded) & set(mine):
        return None
    return (f"{path} was calibrated on another model (weights {recorded[0]}; this model's are {mine[0]}): its "
            "layers are applied as written, but the KL budget it met was measured on that model")


def check_config_for_eval(path: str | Path, model, settings) -> None:
    """Refuse a calibrated file that does not fit an evaluation: other static set, other layer count,
    or a calibration text that shares a paragraph, or :data:`SHARED_RUNS` consecutive runs of
    :data:`SHINGLE_WORDS` words (any shared passage of 203 words or more holds them), with the
    evaluation haystack; note on stderr a file calibrated on
    another model of the same sizes (:func:`other_model_note`).

    The overlap is checked against the file's ``calibration.paragraph_sha1`` and
    ``shingle_sha1`` (written by ``magicpig-jax calibrate``: its paragraphs, and its runs of
    :data:`SHINGLE_WORDS` words, which a reflowed copy shares; shorter shared stretches are the
    boilerplate of related texts, as the default calibration text shares with the default
    haystack); a file without a calibration record (written by hand) has no text to compare.

    Raises:
      ValueError: naming the mismatch, or a malformed calibration record (naming the field).
    """
    from magicpig_jax.attention import LayerConfigs
    from magicpig_jax.eval.corpus import load_prose

    lc = LayerConfigs.load(path)
    try:
        lc.check_model(model.config.model_shape())
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    note = other_model_note(path, getattr(model, "source", None))  # None: a model held in memory
    if note:
        print(f"magicpig-jax: note: eval: {note}", file=sys.stderr, flush=True)
    base = lc.base()
    if lc.sparse_layers and (base.num_sink, base.num_local) != (settings.num_sink, settings.num_local):
        raise ValueError(f"{path}: calibrated with num_sink={base.num_sink}, num_local={base.num_local}; the "
                         f"evaluation uses {settings.num_sink}, {settings.num_local}")
    obj = json.loads(Path(path).read_text())
    record = obj.get("calibration", {})
    if not isinstance(record, dict):
        raise ValueError(f"{path}: 'calibration' must be an object (calibrate's record), got "
                         f"{type(record).__name__}")
    hashes = record.get("paragraph_sha1", [])
    if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
        raise ValueError(f"{path}: 'calibration.paragraph_sha1' must be a list of strings (the calibration "
                         f"text's paragraph hashes)")
    cal = set(hashes)
    hay = {hashlib.sha1(p.encode()).hexdigest()[:12] for p in load_prose(settings.haystack)}
    shared = cal & hay
    if shared:
        raise ValueError(f"{path} was calibrated on a text that shares {len(shared)} paragraph(s) with the "
                         f"evaluation haystack {settings.haystack!r}: calibrate on another text")
    # the same words reflowed (line breaks removed, paragraphs merged) share no paragraph: runs of words
    shingles = record.get("shingle_sha1", [])
    if record.get("shingle_words", SHINGLE_WORDS) != SHINGLE_WORDS or not isinstance(shingles, list) or not all(
            isinstance(h, str) for h in shingles):
        raise ValueError(f"{path}: 'calibration.shingle_sha1' must be a list of strings, of runs of "
                         f"'shingle_words' = {SHINGLE_WORDS} words (the calibration text's)")
    hay_runs = _haystack_shingles(str(settings.haystack))
    longest = streak = 0
    for h in shingles:
        streak = streak + 1 if h in hay_runs else 0
        longest = max(longest, streak)
    if longest >= SHARED_RUNS:
        raise ValueError(f"{path} was calibrated on a text that shares a passage of {longest * SHINGLE_WORDS} words "
                         f"({longest} consecutive runs of {SHINGLE_WORDS}) with the evaluation haystack "
                         f"{settings.haystack!r} (reflowed or not): calibrate on another text")


def _pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        if not item.strip():
            continue
        try:
            k, l_ = (int(x) for x in item.lower().split("x"))
        except ValueError as err:
            raise ValueError(f"--candidates takes KxL pairs like 10x150,11x300, got {text!r}") from err
        out.append((k, l_))
    _check_candidates(out)
    return out


def _check_candidates(candidates) -> None:
    """Each (K, L) a layer may take, valid for the host index, none twice, at least one."""
    from magicpig_jax.host.index import HOST_MAX_K, HOST_MAX_L

    seen = []
    for pair in candidates:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"--candidates: each candidate must be a (K, L) pair, got {pair!r}")
        k, l_ = pair
        for name, v in (("K", k), ("L", l_)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"--candidates {k}x{l_}: {name} must be an int, got {type(v).__name__} {v!r}")
        k, l_ = int(k), int(l_)
        if not 1 <= k <= HOST_MAX_K:  # within lsh.validate_k_l's ranges
            raise ValueError(f"--candidates {k}x{l_}: K must be in [1, {HOST_MAX_K}] (the host index)")
        if not 2 <= l_ <= HOST_MAX_L:  # refused after the model load and the prefill otherwise
            raise ValueError(f"--candidates {k}x{l_}: L must be in [2, {HOST_MAX_L}] (the host index)")
        if (k, l_) in seen:  # each candidate is measured on every layer: a repeat costs a whole pass
            raise ValueError(f"--candidates lists {k}x{l_} more than once")
        seen.append((k, l_))
    if not seen:
        raise ValueError("--candidates is empty")


def check_calibration_args(*, kl_budget: float, length: int, forced_tokens: int, candidates, num_sink: int,
                           num_local: int, probes: int, repeats: int, max_evals: int, cost: str,
                           layers_per_projection: int) -> None:
    """Refuse settings :func:`calibrate` cannot honour, before any model work (the CLI and the API share it).

    Raises:
      ValueError: a budget that is not a positive finite number, an unknown ``cost``, a size below 1,
        ``forced_tokens`` outside ``[2, min(length - 1, LONGEST_MODELLED_DECODE)]`` (the first forced
        token is predicted by the dense prefill; a longer decode appends generated keys to the index,
        which neither the per-layer error nor the byte count models), a prefix no longer than the
        static set, or an invalid candidate (K, L).
      TypeError: a size that is not an int, or a candidate that is not an int pair.
    """
    from magicpig_jax.eval.cost import LONGEST_MODELLED_DECODE

    if not (isinstance(kl_budget, (int, float)) and not isinstance(kl_budget, bool) and math.isfinite(kl_budget)
            and kl_budget > 0):
        raise ValueError(f"--kl-budget must be a positive finite number, got {kl_budget!r}")
    if cost not in COST_KINDS:
        raise ValueError(f"--cost must be one of {COST_KINDS}, got {cost!r}")
    sizes = {"length": length, "forced_tokens": forced_tokens, "probes": probes, "repeats": repeats,
             "max_evals": max_evals, "layers_per_projection": layers_per_projection}
    for name, v in sizes.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{flag} must be an int, got {type(v).__name__} {v!r}")
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if forced_tokens < 2:
        raise ValueError("--forced-tokens must be >= 2: the first forced token is predicted by the dense prefill, "
                         "so one would measure KL 0 whatever the layers")
    if forced_tokens >= length:
        raise ValueError(f"need --forced-tokens < --length, got {forced_tokens} and {length}")
    if forced_tokens > LONGEST_MODELLED_DECODE:
        raise ValueError(f"--forced-tokens ({forced_tokens}) must be at most {LONGEST_MODELLED_DECODE}: a longer "
                         "decode appends generated keys to the index, which the per-layer error and the byte count "
                         "do not model")
    _check_prefix(length, forced_tokens, num_sink, num_local)
    _check_candidates(candidates)


@dataclasses.dataclass
class LayerCosts:
    """What was measured for one layer: per candidate label (``"KxL"`` or ``"dense"``) the ms of its
    attention, the attention error, the fraction of keys sampled and the bytes read per step."""

    ms: dict[str, float]
    error: dict[str, float]
    fraction: dict[str, float]
    bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    ms_fit: dict[str, float] = dataclasses.field(default_factory=dict)

    def cost(self, label: str, kind: str = "ms") -> float:
        """The cost of one choice: ``"ms"`` (the fit across layers, :func:`pool_ms`, where it was made, else the
        layer's own median), ``"ms-per-layer"`` (the layer's own median) or ``"bytes"``."""
        if kind == "ms":
            return self.ms_fit.get(label, self.ms[label])
        if kind == "ms-per-layer":
            return self.ms[label]
        if kind == "bytes":
            return self.bytes[label]
        raise ValueError(f"cost kind must be one of {COST_KINDS}, got {kind!r}")


def pool_ms(per_layer: Sequence[LayerCosts]) -> None:
    """Fill each layer's ``ms_fit``: per choice, a line ``ms = a + b * bytes`` fitted across the layers.

    Every layer of a Llama decoder has the same attention shape (Hq, Hkv, D and the context), so a choice's
    cost differs between layers only through the data: the rows it samples and the buckets it walks, which
    its bytes count (:func:`magicpig_jax.eval.cost.step_bytes`). A layer's own median of ``--repeats``
    calls varies between layers of identical work by more than the choices differ (docs/evaluation.md,
    "Costs pooled across layers"), and a per-layer argmin then follows that noise. The
    fit keeps what the data explain and averages the rest over all layers. The slope is least squares,
    clipped at 0 (a cost never falls with the bytes read); the intercept is the median of ``ms - b *
    bytes``, so that one slow layer moves it little. A choice whose bytes are the same in every layer
    (dense) gets the median over layers.
    """
    if not per_layer:
        return
    for label in per_layer[0].ms:
        x = np.array([c.bytes.get(label, 0.0) for c in per_layer], np.float64)
        y = np.array([c.ms[label] for c in per_layer], np.float64)
        slope = 0.0
        if len(x) >= 3 and np.ptp(x) > 1e-9 * max(np.max(np.abs(x)), 1.0):
            xc = x - x.mean()
            slope = max(float(np.dot(xc, y - y.mean()) / np.dot(xc, xc)), 0.0)
        intercept = float(np.median(y - slope * x))
        for c, xi in zip(per_layer, x, strict=True):
            c.ms_fit[label] = intercept + slope * float(xi)


def _time_choices(fns: dict, repeats: int) -> dict[str, float]:
    """ms of each zero-argument call in ``fns``: the median over ``repeats`` rounds, each round calling every
    choice once, in an order rotated by one per round, after flushing the caches (:data:`FLUSH_BYTES`)."""
    import jax

    for fn in fns.values():
        jax.block_until_ready(fn())  # compile
    flush = np.zeros(FLUSH_BYTES // 8, np.float64)
    labels = list(fns)
    ts: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(repeats):
        for i in range(len(labels)):
            label = labels[(i + r) % len(labels)]
            flush += 1.0  # written, so every line of the caches is evicted
            t0 = time.perf_counter()
            jax.block_until_ready(fns[label]())
            ts[label].append(time.perf_counter() - t0)
    return {label: 1000.0 * float(np.median(v)) for label, v in ts.items()}


def _probe_queries(model, state, ids: list[int], positions: np.ndarray) -> np.ndarray:
    """float32 ``[P, layers, 1, Hq, D]``: each layer's decode query at each probe position."""
    import jax.numpy as jnp
    from flax import nnx

    from magicpig_jax.models.cache import KVCache
    from magicpig_jax.models.decoding import decode_queries

    graphdef, params = nnx.split(model.module)
    queries = []
    for p in positions:  # the query at decode position p sees the keys [0, p)
        cache = KVCache(k=state.cache.k, v=state.cache.v, lengths=jnp.asarray([p], jnp.int32))
        queries.append(np.asarray(decode_queries(graphdef, params, cache, jnp.asarray([ids[p]], jnp.int32))))
    return np.stack(queries)


def measure_layers(model, ids: Sequence[int], prefix_len: int, candidates: Sequence[tuple[int, int]], base,
                   probes: int = 8, repeats: int = 5, progress: bool = True) -> list[LayerCosts]:
    """Per layer and candidate: measured ms of the layer's attention in the host op, and the attention error.

    Args:
      model: the loaded model.
      ids: the calibration tokens (prefilled densely in full; decode positions ``prefix_len ..``).
      prefix_len: the prefill the decoder's index is built on.
      candidates: ``(K, L)`` pairs.
      base: a :class:`MagicPIGConfig` giving the static set and the projection seed.
      probes: decode positions in ``[prefix_len, len(ids))`` whose queries measure the error.
      repeats: timing rounds (each times every choice of the layer once, caches flushed; the median counts).
      progress: a tqdm bar.

    Returns:
      one :class:`LayerCosts` per layer, with ``ms_fit`` filled by :func:`pool_ms`.
    """
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from magicpig_jax.attention import build_lsh_index, dense_attention, magicpig_attention
    from magicpig_jax.eval.cost import step_bytes
    from magicpig_jax.generation import prefill
    from magicpig_jax.host import host_build_index, host_exact_attention, host_magicpig_attention
    from magicpig_jax.models.backends import layer_projections

    ids = list(ids)
    state = prefill(model, [ids], 1)
    positions = np.unique(np.linspace(prefix_len, len(ids) - 1, probes).astype(int))
    q_all = _probe_queries(model, state, ids, positions)  # [P, layers, 1, Hq, D]
    D = model.config.head_dim
    build_len = jnp.asarray([prefix_len], jnp.int32)
    # Gemma 2's attention logit soft-capping, in every estimator as in the decoder
    cap = model.config.attn_logit_softcap
    attend = jax.jit(functools.partial(magicpig_attention, softcap=cap), static_argnames="config")
    build = jax.jit(build_lsh_index, static_argnames="config")
    dense = jax.jit(functools.partial(dense_attention, softcap=cap))
    host_attend = jax.jit(functools.partial(host_magicpig_attention, softcap=cap),
                          static_argnames=("config", "static_window"))
    host_dense = jax.jit(functools.partial(host_exact_attention, softcap=cap))
    configs = {f"{K}x{L}": dataclasses.replace(base, K=K, L=L) for K, L in candidates}
    out = []
    n_layers = model.config.num_layers
    mc = model.config
    shape = dict(num_layers=1, num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=D,
                 context=float(np.mean(positions)), num_sink=base.num_sink,
                 kv_bytes=int(state.cache.k[0].dtype.itemsize),
                 unhashed_tail=float(np.mean(positions)) - prefix_len + base.num_local)
    with tqdm(total=n_layers * len(configs), desc="calibrate: per-layer error and ms", disable=not progress) as bar:
        for layer in range(n_layers):
            k, v = state.cache.k[layer], state.cache.v[layer]
            lens = [jnp.asarray([p], jnp.int32) for p in positions]
            refs = [np.asarray(dense(jnp.asarray(q_all[j, layer]), k, v, lens[j])[0], np.float64)
                    for j in range(len(positions))]
            last_q, last_len = jnp.asarray(q_all[-1, layer]), lens[-1]
            calls = {DENSE: lambda k=k, v=v, q=last_q, n=last_len: host_dense(q, k, v, n)}
            costs = LayerCosts(ms={}, error={DENSE: 0.0}, fraction={DENSE: 1.0},
                               bytes={DENSE: step_bytes("dense", dense_layers=[], fraction_per_layer={},
                                                        num_local=base.num_local, **shape)["total"]})
            for label, cfg in configs.items():
                proj = layer_projections(cfg, layer, D)
                idx = build(k, proj, cfg, build_len)
                errs, fracs = [], []
                for j in range(len(positions)):
                    o, _, num = attend(jnp.asarray(q_all[j, layer]), k, v, idx, cfg, lens[j])
                    o = np.asarray(o, np.float64)
                    errs.append(np.mean(np.sum((o - refs[j]) ** 2, -1) / np.maximum(np.sum(refs[j] ** 2, -1), 1e-30)))
                    fracs.append(float(np.mean(np.asarray(num))) / int(positions[j]))
                hidx = host_build_index(k, proj, cfg, build_len, capacity=k.shape[2])
                calls[label] = (lambda k=k, v=v, q=last_q, n=last_len, h=hidx, c=cfg:
                                host_attend(q, k, v, h, c, n, static_window=0))
                costs.error[label] = float(np.mean(errs))
                costs.fraction[label] = float(np.mean(fracs))
                costs.bytes[label] = step_bytes("magicpig", dense_layers=[], num_local=base.num_local, K=cfg.K,
                                                L=cfg.L, fraction_per_layer={0: costs.fraction[label]},
                                                **shape)["total"]
                bar.update(1)
            costs.ms.update(_time_choices(calls, repeats))
            out.append(costs)
    pool_ms(out)
    return out


def total_cost(per_layer: Sequence[LayerCosts], assignment: Sequence[str], kind: str = "ms") -> float:
    """The summed cost (``kind`` of :meth:`LayerCosts.cost`) of an assignment."""
    return sum(c.cost(p, kind) for c, p in zip(per_layer, assignment, strict=True))


def assignments(per_layer: Sequence[LayerCosts], lambdas: Sequence[float] | None = None,
                kind: str = "ms") -> list[tuple[str, ...]]:
    """The distinct per-layer choices of ``argmin_c cost(l, c) + λ error(l, c)`` over ``lambdas``, cheapest first.

    ``kind`` is one of :data:`COST_KINDS` (:meth:`LayerCosts.cost`). The all-dense assignment is always
    included (KL 0). Default ``lambdas``: every λ at which some layer's choice can change (where two of
    its choices tie, ``(cost_b - cost_a) / (error_a - error_b) > 0``), and a λ between each two of them
    and beyond both ends, so that every assignment the sweep can reach is in the list (a fixed log grid
    skips those between two of its steps).
    """
    if lambdas is None:
        ties = set()
        for c in per_layer:
            for a in c.ms:
                for b in c.ms:
                    dc, de = c.cost(b, kind) - c.cost(a, kind), c.error[a] - c.error[b]
                    if dc > 0 and de > 0:
                        ties.add(dc / de)
        points = sorted(ties)
        if points:
            mids = (math.sqrt(x * y) for x, y in zip(points[:-1], points[1:], strict=True))
            lambdas = [points[0] / 2, *points, *mids, points[-1] * 2]
        else:
            lambdas = [0.0]
    seen: dict[tuple[str, ...], float] = {}
    for lam in lambdas:
        pick = tuple(min(c.ms, key=lambda label, c=c: c.cost(label, kind) + lam * c.error[label]) for c in per_layer)
        seen[pick] = total_cost(per_layer, pick, kind)
    all_dense = tuple(DENSE for _ in per_layer)
    seen[all_dense] = total_cost(per_layer, all_dense, kind)
    return sorted(seen, key=lambda a: seen[a])


def to_layer_configs(assignment: Sequence[str], base, info: dict | None = None):
    """A :class:`LayerConfigs` of per-layer labels (``"KxL"`` or ``"dense"``) with ``base``'s static set and seed."""
    from magicpig_jax.attention import LayerConfigs

    layers = []
    for i, label in enumerate(assignment):
        if label == DENSE:
            layers.append((i, DENSE))
        else:
            K, L = (int(x) for x in label.split("x"))
            layers.append((i, dataclasses.replace(base, K=K, L=L)))
    return LayerConfigs(tuple(layers), tuple((str(k), str(v)) for k, v in (info or {}).items()), static=base)


def _kl_of(model, state, layer_configs, targets, logp_dense) -> float:
    from magicpig_jax.eval.forcing import forced_decode
    from magicpig_jax.eval.likelihood import LogitsRecorder, compare_to_dense

    rec = LogitsRecorder(len(targets))
    forced_decode(model, state, forced_tokens=[targets], logits_callback=rec, attention="magicpig",
                  config=layer_configs, max_new_tokens=len(targets), stop_on_eos=False)
    return compare_to_dense(rec.logp, logp_dense, targets)["kl"]


def _check_prefix(length: int, forced_tokens: int, num_sink: int, num_local: int) -> None:
    """The prefix must reach past the static set, or no key is ever sampled and every candidate
    measures KL 0 at no cost (a file that says nothing)."""
    if length - forced_tokens <= num_sink + num_local:
        raise ValueError(f"the prefix (--length - --forced-tokens = {length - forced_tokens}) must be longer than "
                         f"--num-sink + --num-local = {num_sink + num_local}: no key of a shorter one is sampled")


def _check_context(length: int, context: int) -> None:
    if length > context:
        raise ValueError(f"--length {length} is past the model's context of {context} tokens (the prefix and "
                         f"the forced tokens must fit in it): use --length <= {context}")


def calibrate(model, text: str, kl_budget: float, *, length: int = 4096, forced_tokens: int = 128,
              candidates: Sequence[tuple[int, int]] = ((8, 75), (9, 120), (10, 150), (11, 300), (12, 600)),
              num_sink: int = 4, num_local: int = 64, seed: int = 0, probes: int = 8, repeats: int = 5,
              max_evals: int = 8, cost: str = "ms", progress: bool = True, layers_per_projection: int = 1):
    """Calibrate per-layer configs on ``text`` (see the module docstring); returns ``(LayerConfigs, report)``.

    The configs record the model's sizes (``model_shape``, checked where the file is used) and the
    report the text's paragraph hashes (``calibration.paragraph_sha1``, which ``eval`` compares with
    its haystack): save them with ``configs.save(path, extra=report)``. ``report["search_complete"]``
    is False when ``max_evals`` ran out before the search converged (a note is printed).

    Raises:
      ValueError: the settings :func:`check_calibration_args` refuses (a budget that is not positive
        and finite, ``forced_tokens`` outside ``[2, 511]``, sizes below 1, a prefix
        ``length - forced_tokens`` no longer than the static set ``num_sink + num_local``, an invalid
        or repeated candidate, no candidate), a ``length`` past the model's context
        (``max_position_embeddings``: the teacher-forced tokens are decoded after the prefix, so all
        ``length`` positions must be in it), a text shorter than ``length`` tokens, or a model whose
        every layer has a sliding window shorter than ``length`` (layers with one are kept dense).
      TypeError: a size or candidate of the wrong type.
    """
    from magicpig_jax.attention import MagicPIGConfig
    from magicpig_jax.eval.forcing import forced_decode
    from magicpig_jax.eval.likelihood import LogitsRecorder
    from magicpig_jax.generation import cache_capacity, prefill

    check_calibration_args(kl_budget=kl_budget, length=length, forced_tokens=forced_tokens, candidates=candidates,
                           num_sink=num_sink, num_local=num_local, probes=probes, repeats=repeats,
                           max_evals=max_evals, cost=cost, layers_per_projection=layers_per_projection)
    _check_context(length, model.config.max_position_embeddings)
    base = MagicPIGConfig(num_sink=num_sink, num_local=num_local, seed=seed,
                          layers_per_projection=layers_per_projection)
    from magicpig_jax.eval.likelihood import document_encoder

    ids = document_encoder(model.tokenizer)(text)  # the model's BOS first, as the eval's likelihood documents
    if len(ids) < length:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than --length {length}")
    ids = ids[:length]
    # A layer whose sliding window is shorter than the run decodes exactly over it (decode_spec): dense.
    window = model.config.sliding_window
    positions = cache_capacity(model, length - forced_tokens, forced_tokens)  # the prefill's cache below
    windowed = {i for i in model.config.windowed_layers if window < positions}
    if len(windowed) == model.config.num_layers:
        raise ValueError(f"every layer of this model attends through a sliding window of {window} tokens, "
                         f"shorter than the run's cache of {positions} positions (--length {length}, rounded up): "
                         "no layer can be sparse, nothing to calibrate")
    prefix_len = length - forced_tokens
    prefix, targets = ids[:prefix_len], ids[prefix_len:]
    t0 = time.perf_counter()
    state = prefill(model, [prefix], forced_tokens)
    rec = LogitsRecorder(forced_tokens)
    forced_decode(model, state, forced_tokens=[targets], logits_callback=rec, attention="dense",
                  max_new_tokens=forced_tokens, stop_on_eos=False)
    logp_dense = rec.logp
    per_layer = measure_layers(model, ids, prefix_len, candidates, base, probes, repeats, progress)
    for i in windowed:  # only the exact choice for them
        c = per_layer[i]
        per_layer[i] = LayerCosts(*({DENSE: d[DENSE]} if DENSE in d else {} for d in
                                    (c.ms, c.error, c.fraction, c.bytes, c.ms_fit)))
    order = assignments(per_layer, kind=cost)
    ms = {a: total_cost(per_layer, a, "ms") for a in order}  # the fit across layers, whatever ``cost`` is
    nbytes = {a: total_cost(per_layer, a, "bytes") for a in order}
    tried: dict[tuple[str, ...], float] = {order[-1]: 0.0}  # all dense
    lo, hi = 0, len(order) - 1  # the answer is in [lo, hi]; order[hi] is known to meet the budget
    evals = 0
    while lo < hi and evals < max_evals:
        mid = (lo + hi) // 2
        a = order[mid]
        kl = _kl_of(model, state, to_layer_configs(a, base), targets, logp_dense)
        tried[a] = kl
        evals += 1
        if progress:
            print(f"calibrate: assignment {mid + 1}/{len(order)} ({ms[a]:.2f} ms, {nbytes[a] / 1e6:.2f} MB of "
                  "attention per step, "
                  f"{sum(x != DENSE for x in a)} sparse layers): KL {kl:.4f}", file=sys.stderr, flush=True)
        if kl <= kl_budget:
            hi = mid
        else:
            lo = mid + 1
    best = order[hi]
    complete = lo >= hi  # False: --max-evals ran out with assignments between lo and hi unmeasured
    if not complete:
        print(f"calibrate: note: --max-evals {max_evals} ran out before the search converged; the "
              f"{hi - lo} cheaper assignment(s) not measured may meet the budget (raise --max-evals)",
              file=sys.stderr, flush=True)
    if len(order) == 1:
        print("calibrate: note: no candidate costs less than dense attention in any layer: every layer stays dense",
              file=sys.stderr, flush=True)
    elif all(x == DENSE for x in best):
        print(f"calibrate: note: no measured assignment with a sparse layer met the KL budget {kl_budget}: every "
              "layer stays dense", file=sys.stderr, flush=True)
    from magicpig_jax.eval.corpus import text_paragraphs

    identities = _identities(model.source)  # which model was measured (other_model_note)
    report = {
        "kl_budget": kl_budget, "measured_kl": tried.get(best), "cost": cost,
        "attention_ms_per_step": ms[best], "dense_attention_ms_per_step": ms[order[-1]],
        "attention_bytes_per_step": nbytes[best], "dense_attention_bytes_per_step": nbytes[order[-1]],
        "calibration": {"weights_id": identities[0], "source_weights_id": identities[1],
                        "length": length, "forced_tokens": forced_tokens, "probes": probes, "repeats": repeats,
                        "candidates": [f"{k}x{l_}" for k, l_ in candidates], "num_sink": num_sink,
                        "num_local": num_local, "seed": seed, "layers_per_projection": layers_per_projection,
                        # what eval's overlap check compares with its haystack (check_config_for_eval)
                        "paragraph_sha1": [hashlib.sha1(p.encode()).hexdigest()[:12] for p in text_paragraphs(text)],
                        "shingle_words": SHINGLE_WORDS, "shingle_sha1": shingle_hashes(text.split(), disjoint=True)},
        "search_complete": complete,
        "per_layer": [{"layer": i, "choice": best[i], "ms": c.ms, "ms_fit": c.ms_fit, "bytes": c.bytes,
                       "error": c.error, "fraction": c.fraction} for i, c in enumerate(per_layer)],
        "tried": [{"ms": ms[a], "bytes": nbytes[a], "kl": kl, "sparse_layers": sum(x != DENSE for x in a),
                   "assignment": list(a)} for a, kl in sorted(tried.items(), key=lambda x: ms[x[0]])],
        "assignments": len(order),
        "seconds": time.perf_counter() - t0,
    }
    return dataclasses.replace(to_layer_configs(best, base), model_shape=model.config.model_shape()), report


# --- command line -----------------------------------------------------------------------------

def make_parser() -> argparse.ArgumentParser:
    """The argument parser of ``magicpig-jax calibrate`` (its epilog points at the module docstring)."""
    p = Parser(prog="magicpig-jax calibrate",
               description="Per layer MagicPIG's (K, L) or dense, meeting a KL budget at the least measured cost, "
                           "on a text that is not an evaluation text; a JSON file for --magicpig-config.",
               epilog="Details (method, outputs, sources): python -m pydoc magicpig_jax.eval.calibrate")
    p.add_argument("--model", default=None, help="GGUF file, Hugging Face or checkpoint directory (default: "
                                                  "the embedded SmolLM2)")
    p.add_argument("--kl-budget", type=float, required=True, help="mean KL(dense || method) per token to meet")
    p.add_argument("--out", type=path_arg, required=True, help="the JSON file to write")
    p.add_argument("--text", type=path_arg, default=DEFAULT_TEXT,
                   help="calibration text, not an evaluation text (default: the bundled LGPL-2.1)")
    p.add_argument("--length", type=int, default=4096, help="tokens of the text used (prefill + forced)")
    p.add_argument("--forced-tokens", type=int, default=128, help="teacher-forced tokens over which KL is measured")
    p.add_argument("--candidates", default=DEFAULT_CANDIDATES, help="(K, L) pairs a layer may take, KxL,...")
    p.add_argument("--num-sink", type=int, default=4, help="sink tokens kept exactly")
    p.add_argument("--num-local", type=int, default=64, help="local window of the prompt kept exactly")
    p.add_argument("--seed", type=int, default=0, help="seed of the SimHash projections")
    p.add_argument("--layers-per-projection", type=int, default=1,
                   help="consecutive layers sharing one SimHash projection matrix (1: one per layer)")
    p.add_argument("--probes", type=int, default=8, help="decode positions measuring each layer's error")
    p.add_argument("--repeats", type=int, default=5,
                   help="timing rounds per layer: each calls every choice once, caches flushed (the median counts)")
    p.add_argument("--max-evals", type=int, default=8, help="teacher-forced decodes measuring the KL")
    p.add_argument("--cost", choices=list(COST_KINDS), default="ms",
                   help="what to minimize: measured ms of a layer's attention fitted across the layers (ms), each "
                        "layer's own median (ms-per-layer), or the bytes it reads")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (for logs)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``magicpig-jax calibrate``; returns 0 (errors are raised as ValueError / FileNotFoundError)."""
    from magicpig_jax.io.loader import load_model

    args = make_parser().parse_args(argv)
    candidates = _pairs(args.candidates)
    if not args.text.is_file():
        raise FileNotFoundError(f"--text {args.text} is not a file")
    check_calibration_args(kl_budget=args.kl_budget, length=args.length, forced_tokens=args.forced_tokens,
                           candidates=candidates, num_sink=args.num_sink, num_local=args.num_local,
                           probes=args.probes, repeats=args.repeats, max_evals=args.max_evals, cost=args.cost,
                           layers_per_projection=args.layers_per_projection)
    from magicpig_jax.argparsing import check_output, in_flag_terms, model_input
    from magicpig_jax.attention import MagicPIGConfig

    with in_flag_terms(num_sink="--num-sink", num_local="--num-local", seed="--seed"):
        MagicPIGConfig(num_sink=args.num_sink, num_local=args.num_local, seed=args.seed)
    check_output("--out", args.out, "file", inputs={"--text": args.text, "--model": model_input(args.model)})
    try:
        # newlines kept as they are (no universal-newline translation): the paragraphs recorded
        # are then split as eval's load_prose splits this file (a CR-only file is one paragraph in both)
        text = args.text.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--text {args.text} is not UTF-8 text (byte {err.start})") from None
    from magicpig_jax.io.loader import read_model_config

    _check_context(args.length, read_model_config(args.model).max_position_embeddings)  # before the load
    model = load_model(args.model)
    lc, report = calibrate(model, text, args.kl_budget, length=args.length, forced_tokens=args.forced_tokens,
                           candidates=candidates, num_sink=args.num_sink, num_local=args.num_local, seed=args.seed,
                           probes=args.probes, repeats=args.repeats, max_evals=args.max_evals, cost=args.cost,
                           progress=not args.no_progress, layers_per_projection=args.layers_per_projection)
    report["model"] = str(model.source)
    report["calibration"].update({"text": str(args.text), "sha256": hashlib.sha256(text.encode()).hexdigest()})
    lc = dataclasses.replace(lc, info=(("model", str(model.source)), ("kl_budget", str(args.kl_budget))))
    path = lc.save(args.out, extra=report)
    sparse = len(lc.sparse_layers)
    print(f"wrote {path}: {sparse} sparse layers, dense {list(lc.dense_layers)}; measured KL "
          f"{report['measured_kl']:.4f} (budget {args.kl_budget}); attention {report['attention_ms_per_step']:.2f} ms "
          f"and {report['attention_bytes_per_step'] / 1e6:.2f} MB per step against "
          f"{report['dense_attention_ms_per_step']:.2f} ms and {report['dense_attention_bytes_per_step'] / 1e6:.2f} MB "
          "dense (measured per layer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
