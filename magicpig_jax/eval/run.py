"""``magicpig-jax eval``: long-context task accuracy and likelihood versus cost, per attention method.

Reproduces the kind of comparison of arXiv 2410.16179, Section 5.1 (Table 3, RULER) and
Section 3 (Fig. 2: TopK is biased on aggregation tasks) on the real model: every method
decodes from the *same* dense prefill of each sample (prefill once, decode per method),
with the same static set (``--num-sink`` sinks + ``--num-local`` local tokens + generated
tokens) and the same dense layers.

Methods (``--methods``, comma-separated):

``dense``               exact attention.
``magicpig:KxL``        MagicPIG with K bits and L tables (``magicpig`` alone = 10x150): the
                        host op on the CPU backend (:mod:`magicpig_jax.host`), the pure-JAX
                        path elsewhere; ``magicpig-ref:KxL`` forces the pure-JAX reference.
``hybrid:KxLxM``        the hybrid estimator (:mod:`magicpig_jax.attention.hybrid`): keys that
                        collide in >= M tables kept exactly, the rest weighted by 1/u_c (pure JAX).
``magicpig@FILE``       MagicPIG with the per-layer configurations of ``magicpig-jax calibrate``'s
                        FILE (also ``--magicpig-config FILE``); its calibration text must not be
                        in the haystack.
``topk`` / ``quest`` / ``oracle``
                        exact TopK, Quest (``--page-size`` pages), oracle sampling
                        (Definition 3.1), each with a per-sample budget equal to the *measured*
                        mean number of keys the ``--budget-from`` method (default
                        ``magicpig:10x150``) sampled on the same sample, rounded to a multiple
                        of ``--page-size`` (at least one page; the rounding bounds the number
                        of distinct jit compilations). The reference method is run first (it
                        is added to the list if missing). ``topk:N`` / ``topk:0.02`` fix the
                        budget instead (tokens / fraction of the middle range). On the CPU
                        backend TopK and Quest run their host ops (:mod:`magicpig_jax.host.topk`,
                        :mod:`magicpig_jax.host.quest`); ``topk-ref`` / ``quest-ref`` force pure JAX.

Work: for each length, sample index, task and RULER setup a RULER-style sample
(:mod:`magicpig_jax.eval.tasks`) is generated to fill ``length`` tokens (prompt + new
tokens, chat template applied) and decoded greedily by each method from one shared prefill;
the answer is scored as RULER does. The setups (``--setups``):

* ``A``: the whole prompt, question included, is prefilled densely; the methods decode the answer
  (the question is inside the dense prefill);
* ``B``: the document is prefilled densely; each method decodes the question, the end of the
  user turn and the answer prefix (teacher-forced), then the answer (the question is decoded
  sparsely, after the document).

Unless ``--likelihood-tokens 0``, each length also gets ``--likelihood-samples`` prose samples
(:mod:`magicpig_jax.eval.likelihood`): dense prefill of all but the last N tokens, then
teacher-forced decoding of those N by each method: perplexity, KL(dense || method), top-1
agreement.

Cost, per record: the fraction of keys used, the measured milliseconds per decode step, and the
bytes of K, V, index and page metadata a step reads (:mod:`magicpig_jax.eval.cost`).

Outputs in ``--out``:

* ``results.jsonl`` — one JSON record per (sample, method), appended and fsync'ed as soon as
  it is computed. A rerun of the same command skips every record already there, so an
  interrupted run resumes where it stopped and loses nothing (a partially written last line
  is dropped). ``config.json`` pins the settings that make records comparable (model,
  haystack, seed, static set, dense layers, new tokens, ...): a rerun with different ones
  is refused. ``runs.jsonl`` logs every invocation (machine, wall time, records added).
* ``summary.md`` — per length and setup: accuracy per task and method and the mean
  accuracy, each with its 95% interval; cost (fraction of keys, ms per step, bytes per step);
  KL, perplexity and top-1 agreement with their 95% intervals
  (:mod:`magicpig_jax.eval.stats`); printed as well. ``summary.json`` has the same numbers.
* ``accuracy_vs_cost.png``, ``kl_vs_cost.png`` (against the fraction of keys) and the Pareto
  charts ``kl_vs_ms.png`` and ``accuracy_vs_ms.png`` (against measured ms per step), with
  the intervals as error bars (matplotlib).

Modules: :mod:`~magicpig_jax.eval.methods` (parsing ``--methods``), :mod:`~magicpig_jax.eval.store`
(the files above), :mod:`~magicpig_jax.eval.report` (summary and plots) and this one (the loop
and the command line), which re-exports their public names.

Example (the full run of docs/evaluation.md)::

    magicpig-jax eval --tasks niah_single,niah_multikey --lengths 2K,4K,8K --samples 20 \\
        --likelihood-samples 16 --setups A,B --out runs/eval
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

from magicpig_jax.eval.cost import LONGEST_MODELLED_DECODE
from magicpig_jax.eval.methods import DEFAULT_METHODS, Method, parse_lengths, parse_method, parse_methods
from magicpig_jax.eval.plots import write_plots
from magicpig_jax.eval.report import finish, format_summary, summarize
from magicpig_jax.eval.settings import (
    FINGERPRINT_DEFAULTS,
    EvalSettings,
    make_parser,
    option_readers,
    settings_from_args,
)
from magicpig_jax.eval.store import RESULTS, ResultStore, check_fingerprint, log_invocation, machine_info, record_key
from magicpig_jax.memory import release_compiled_programs

__all__ = [
    "main",
    "make_parser",
    "settings_from_args",
    "EvalSettings",
    "run_eval",
    "prompt_ids",
    # re-exported from methods, store and report
    "Method",
    "parse_methods",
    "parse_lengths",
    "DEFAULT_METHODS",
    "ResultStore",
    "record_key",
    "machine_info",
    "summarize",
    "format_summary",
    "write_plots",
    "finish",
]




def prompt_ids(model, prompt: str, answer_prefix: str = "") -> list[int]:
    """Token ids of a task prompt: the user message in the model's chat template, then the
    answer prefix as the start of the assistant's turn (as RULER appends it).

    Without an answer prefix this is :func:`magicpig_jax.generation.encode_prompt`; a model
    without a chat template gets ``prompt + "\\n" + answer_prefix`` raw.
    """
    from magicpig_jax.generation import encode_prompt

    if not model.tokenizer.chat_template:
        return encode_prompt(model, prompt + ("\n" + answer_prefix if answer_prefix else ""), chat=False)
    if not answer_prefix:
        return encode_prompt(model, prompt)
    # The answer prefix opens the assistant's turn: literal text after the rendered header.
    return encode_prompt(model, prompt) + model.tokenizer.encode(answer_prefix, parse_special=False)




def question_split(decode: Callable[[list[int]], str], ids: list[int], question: str) -> int:
    """The largest ``t`` such that ``decode(ids[t:])`` still contains ``question`` (setup B's prefill ends there).

    Raises:
      ValueError: the question is not in the decoded prompt at all.
    """
    question = question.strip()
    if question not in decode(ids):
        raise ValueError(f"the question {question[:60]!r} is not in the prompt")
    lo, hi = 0, len(ids)  # decode(ids[lo:]) contains it; decode(ids[hi:]) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if question in decode(ids[mid:]):
            lo = mid
        else:
            hi = mid
    return lo


def _budget_tokens(ref: dict | None, page: int) -> tuple[int, float | None]:
    """The budget from the reference record: its mean sampled keys, rounded to pages."""
    if ref is None or ref.get("mean_sampled_keys") is None:
        return page, None
    keys = float(ref["mean_sampled_keys"])
    return max(page, int(round(keys / page)) * page), keys


@functools.cache
def _layer_configs(path: str):
    from magicpig_jax.attention import LayerConfigs

    return LayerConfigs.load(path)


def _record_fields(m: Method, stats: dict, prompt_tokens: int, model, settings: EvalSettings, kv_bytes: int) -> dict:
    """The fields every record has: the method, the decode statistics, the cost (fraction of keys,
    ms per step, bytes per step), the time."""
    from magicpig_jax.eval.cost import ms_per_step, step_bytes

    steps = stats["decode_steps"]
    frac = stats["sampled_fraction"]
    context = prompt_tokens + 1 + max(steps - 1, 0) / 2
    mean_keys = None if frac is None else frac * context
    cfg = model.config
    layer_kl = None
    if m.config_file is not None:
        lc = _layer_configs(m.config_file)
        layer_kl = {i: (lc.config(i).K, lc.config(i).L) for i in lc.sparse_layers}
    nbytes = step_bytes(m.backend, num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                        head_dim=cfg.head_dim, context=context, dense_layers=stats["dense_layers"],
                        fraction_per_layer=stats["sampled_fraction_per_layer"], num_sink=settings.num_sink,
                        num_local=settings.num_local, kv_bytes=kv_bytes, K=m.K or 10, L=m.L or 150,
                        layer_kl=layer_kl, page_size=settings.page_size,
                        # the static set's tail: the local window and the tokens generated so far, which every
                        # sparse backend attends exactly (as calibrate counts them; the eval's decodes are
                        # shorter than the generation buffer, after which they would join the sampled range)
                        unhashed_tail=settings.num_local + context - prompt_tokens,
                        layer_windows={i: cfg.layer_window(i) for i in cfg.windowed_layers})
    return {"method": m.label, "backend": m.backend, "K": m.K, "L": m.L, "heavy": m.heavy,
            "config_file": m.config_file,
            "config_sha1": None if m.config_file is None else _file_sha1(m.config_file),
            "attention_runs_on": stats.get("attention_runs_on"),
            "prompt_tokens": prompt_tokens, "sampled_fraction": 1.0 if m.backend == "dense" else frac,
            "sampled_fraction_per_layer": stats["sampled_fraction_per_layer"],
            "mean_sampled_keys": mean_keys, "decode_steps": steps, "decode_tokens": stats["decode_tokens"],
            "decode_seconds": stats["decode_seconds"], "decode_tokens_per_s": stats["decode_tokens_per_s"],
            "ms_per_step": ms_per_step(stats), "bytes_per_step": nbytes,
            "compile_seconds": stats["compile_seconds"], "index_build_seconds": stats["index_build_seconds"],
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def _itemsize(state) -> int:
    """Bytes per K/V element of a prefill's cache."""
    return int(state.cache.k[0].dtype.itemsize)


def _units(settings: EvalSettings) -> list[tuple[str, str, int, int, str]]:
    """Every (kind, task, length, index, setup) to run: the task samples (each setup), then the
    likelihood samples, per length."""
    units: list[tuple[str, str, int, int, str]] = []
    for length in settings.lengths:
        for index in range(settings.samples):
            units.extend(("task", task, length, index, setup) for task in settings.tasks for setup in settings.setups)
        if settings.likelihood_tokens > 0:
            n_lik = settings.likelihood_documents
            units.extend(("likelihood", "prose", length, index, "A") for index in range(n_lik))
    return units


def _key(key: dict, label: str) -> tuple:
    """The store key (:func:`record_key`) of ``key`` = {kind, task, length, index, setup} and a method."""
    return (key["kind"], key["task"], key["length"], key["index"], label, key["setup"])


def _method_spec(model, s: EvalSettings, dense_layers, m: Method, budget, positions: int | None = None):
    """The :class:`~magicpig_jax.models.backends.DecodeSpec` of method ``m`` (validated)."""
    from magicpig_jax.attention import HybridConfig, MagicPIGConfig
    from magicpig_jax.generation import decode_spec

    if m.config_file is not None:
        config, dense = _layer_configs(m.config_file), None
    elif m.backend == "hybrid":
        config = HybridConfig(K=m.K or 10, L=m.L or 150, heavy=m.heavy or 8, num_sink=s.num_sink,
                              num_local=s.num_local, seed=s.seed, layers_per_projection=s.layers_per_projection)
        dense = dense_layers
    else:
        config = MagicPIGConfig(K=m.K or 10, L=m.L or 150, num_sink=s.num_sink, num_local=s.num_local,
                                seed=s.seed, layers_per_projection=s.layers_per_projection)
        dense = dense_layers
    try:
        spec = decode_spec(model, m.backend, config, dense, budget, s.page_size, positions=positions)
    except ValueError as err:
        if m.config_file is None:
            raise
        raise ValueError(f"{m.label} ({m.config_file}): {err}") from None
    return dataclasses.replace(spec, host=False) if m.host is False else spec


def _file_sha1(path: str | Path) -> str:
    return hashlib.sha1(Path(path).read_bytes()).hexdigest()[:12]


def _check_before_writing(model, settings: EvalSettings, dense_layers) -> None:
    """Every check of the settings that needs no results, before ``out`` is created or written.

    Raises:
      ValueError: a length beyond the model's context, or too small for a task's haystack, a
        calibrated file that does not fit, a method whose spec is invalid (e.g. a negative
        ``num_sink``, a dense layer out of range, K too large for the host index), or settings
        that leave nothing to decode sparsely
        (:func:`_check_likelihood_and_answers`).
    """
    from magicpig_jax.eval.calibrate import check_config_for_eval
    from magicpig_jax.generation import cache_capacity

    ctx_limit = model.config.max_position_embeddings
    for length in settings.lengths:
        if length > ctx_limit:
            raise ValueError(f"length {length} exceeds the model's context of {ctx_limit} tokens")
    _check_likelihood_and_answers(model, settings)
    if settings.tasks and settings.samples > 0:  # a length too small for a task's haystack fails its samples
        from magicpig_jax.eval.tasks import MAX_NEW_TOKENS, check_length_fits

        for task in settings.tasks:  # every sample of every length: each draws its own keys and words
            new = MAX_NEW_TOKENS[task] if settings.max_new_tokens is None else settings.max_new_tokens
            for length in settings.lengths:
                smallest = check_length_fits(task, length, lambda p, a: len(prompt_ids(model, p, a)),
                                             seed=settings.seed, haystack=settings.haystack,
                                             max_new_tokens=settings.max_new_tokens, samples=settings.samples)
                if "B" not in settings.setups:
                    continue
                for index, (prompt, prefix) in enumerate(smallest):  # setup B decodes its question part too
                    ids = prompt_ids(model, prompt, prefix)
                    question = len(ids) - question_split(model.tokenizer.decode, ids, prompt.rsplit("\n", 1)[-1])
                    _check_decode_length(question + new, f"setup B of {task} at {length} (sample "
                                         f"{index}: {question} question tokens + {new} new tokens)")
    # a sample's prompt and its decoded tokens fill its length (RULER's sizing; the likelihood task's too)
    positions = cache_capacity(model, max(settings.lengths), 1)
    for m in settings.methods:
        if m.config_file is not None:
            check_config_for_eval(m.config_file, model, settings)
        # a budget measured per sample is unknown yet: any valid one checks the rest of the spec; the
        # positions of the longest run (sliding windows shorter than it make their layers dense)
        _method_spec(model, settings, dense_layers, m, 1 if m.budgeted and m.budget is None else m.budget,
                     positions)


def _check_decode_length(n: int, what: str) -> None:
    """Refuse a decode longer than the byte count models (:data:`~magicpig_jax.eval.cost.LONGEST_MODELLED_DECODE`)."""
    if n > LONGEST_MODELLED_DECODE:
        raise ValueError(f"{what} must be at most {LONGEST_MODELLED_DECODE} decoded tokens: a longer decode appends "
                         "generated keys to the index, which the bytes-per-step count does not model")


def _check_likelihood_and_answers(model, settings: EvalSettings) -> None:
    """Refuse settings under which no method would decode anything sparsely (every method would
    report dense's numbers, KL 0), or that the likelihood documents cannot meet, before anything is
    written: a failure after the task samples would also pin the bad value in ``config.json``."""
    sparse = any(m.backend != "dense" for m in settings.methods)
    n_lik = settings.likelihood_documents
    forced = settings.likelihood_tokens
    if forced > 0 and n_lik > 0:
        if forced < 2:
            raise ValueError("--likelihood-tokens must be 0 (no likelihood task) or >= 2: the first forced token "
                             "is predicted by the dense prefill, so 1 would compare no decode step")
        static = settings.num_sink + settings.num_local
        for length in settings.lengths:
            if forced >= length:
                raise ValueError(f"--likelihood-tokens ({forced}) must be below every length (got {length})")
            if sparse and length - forced <= static:
                raise ValueError(
                    f"--likelihood-tokens ({forced}) leaves a prefix of {length - forced} tokens at length {length}, "
                    f"not longer than the static set (--num-sink + --num-local = {static}): no key would be sampled")
        from magicpig_jax.eval.likelihood import document_encoder, make_likelihood_sample

        # the corpus must hold the longest sample (the same text the run builds; a short FILE fails here)
        make_likelihood_sample(document_encoder(model.tokenizer), max(settings.lengths), 0, seed=settings.seed,
                               haystack=settings.haystack, forced=forced)
    for name, n in (("--likelihood-tokens", forced if n_lik > 0 else 0),  # None: each task's own (short) answer
                    ("--max-new-tokens", (settings.max_new_tokens or 0) if settings.tasks else 0)):
        _check_decode_length(n, f"{name} ({n})")
    if sparse and settings.tasks and "A" in settings.setups and settings.max_new_tokens == 1:
        raise ValueError("--max-new-tokens 1 with setup A: the answer's only token comes from the dense prefill, so "
                         "every sparse method would answer as dense; use >= 2 or --setups B")


def _check_config_files_unchanged(store: ResultStore, settings: EvalSettings, out: Path) -> None:
    """Refuse a ``magicpig@FILE`` whose file changed since its records in ``out`` were written.

    The records are keyed by the label ``magicpig@<stem>``: without this, a changed file would
    silently keep the old file's results.
    """
    for m in settings.methods:
        if m.config_file is None:
            continue
        sha = _file_sha1(m.config_file)
        old = {r.get("config_sha1") for r in store.records.values() if r.get("method") == m.label} - {None}
        if old - {sha}:
            raise ValueError(f"{m.config_file} (sha1 {sha}) is not the file {out} recorded {m.label} with (sha1 "
                             f"{', '.join(sorted(old))}): it changed, or another file has its name; use another "
                             "--out or another file name")


@dataclasses.dataclass
class _Loop:
    """One sample at a time: prefill once, decode with every method still missing, store each record."""

    model: object
    settings: EvalSettings
    store: ResultStore
    dense_layers: list[int]
    on_record: Callable[[dict], None] | None
    progress: bool

    def __post_init__(self) -> None:
        self.ref_label = parse_method(self.settings.budget_from).label
        # setup B's prefill of a sample, taken from its setup-A prefill (prefill_with_prefixes)
        self.prefix_states: dict[tuple, tuple] = {}

    def todo(self, key: dict) -> list[Method]:
        return [m for m in self.settings.methods if _key(key, m.label) not in self.store]

    def spec(self, m: Method, budget, positions: int | None = None):
        """The :class:`~magicpig_jax.models.backends.DecodeSpec` of method ``m`` for a cache of ``positions``."""
        return _method_spec(self.model, self.settings, self.dense_layers, m, budget, positions)

    def decode(self, m: Method, state, n_new: int, key: dict, desc: str, forced=None, then_sample: bool = False):
        """Decode with method m; return (token ids, stats, budget fields).

        ``forced``: ``(targets, recorder)`` teacher-forces ``targets`` through
        :func:`magicpig_jax.eval.forcing.forced_decode` and hands each step's logits to ``recorder``
        (None: no logits); with ``then_sample`` the targets are a prefix and the rest is greedy.
        """
        from tqdm import tqdm

        from magicpig_jax.eval.forcing import forced_decode
        from magicpig_jax.generation import Sampling

        s = self.settings
        budget, measured = m.budget, None
        if m.budgeted and budget is None:
            budget, measured = _budget_tokens(self.store.get(_key(key, self.ref_label)), s.page_size)
        spec = self.spec(m, budget, state.cache.capacity)
        # the per-document bars only on a terminal (in a log file each update is a line)
        bar = tqdm(total=max(n_new - 1, 0), desc=desc, unit="tok", leave=False, disable=None if self.progress else True)
        try:
            targets, recorder = forced if forced is not None else (None, None)
            outs, stats = forced_decode(self.model, state, spec=spec, max_new_tokens=n_new,
                                        sampling=Sampling(seed=s.seed), progress=bar.update,
                                        forced_tokens=None if targets is None else [targets],
                                        logits_callback=recorder, then_sample=then_sample,
                                        stop_on_eos=forced is None or then_sample)
        finally:
            bar.close()
        return outs[0], stats, {"budget": budget, "budget_measured_keys": measured}

    def emit(self, rec: dict) -> None:
        self.store.append(rec)
        if self.on_record is not None:
            self.on_record(rec)

    def task(self, task: str, length: int, index: int, setup: str = "A") -> None:
        """A RULER-style sample: prefill it once, decode greedily with each method, score the answer.

        Setup A prefills the whole prompt; setup B prefills the document only and each method
        decodes the rest of the prompt (the question, teacher-forced) before the answer.
        """
        from magicpig_jax.eval.tasks import make_sample, score
        from magicpig_jax.generation import prefill, prefill_with_prefixes

        model, s = self.model, self.settings
        key = {"kind": "task", "task": task, "length": length, "index": index, "setup": setup}
        todo = self.todo(key)
        if not todo:
            return
        sample = make_sample(task, length, index, lambda p, a: len(prompt_ids(model, p, a)),
                             seed=s.seed, haystack=s.haystack, max_new_tokens=s.max_new_tokens)
        ids = prompt_ids(model, sample.prompt, sample.answer_prefix)
        new = sample.max_new_tokens
        split = len(ids) if setup == "A" else question_split(model.tokenizer.decode, ids, sample.question)
        prefix, forced = ids[:split], ids[split:]
        # checked for every sample before the run (_check_before_writing); the full haystack's tokens here
        _check_decode_length(len(forced) + new,
                             f"setup {setup} of {task} at {length} (sample {index}: {len(forced)} question tokens + "
                             f"{new} new tokens)")
        # capacity = round_up(length): every sample of a length shares the jit compilations
        capacity = max(length - len(prefix) - 1, len(forced) + new)
        sample_key = (task, length, index)
        b_key = {**key, "setup": "B"}
        if setup == "A" and "B" in s.setups and self.todo(b_key):
            # one prefill for both setups: setup B's document is this prompt's prefix
            b_split = question_split(model.tokenizer.decode, ids, sample.question)
            # (the same capacity as a prefill of either setup alone: round_up(length))
            state, b_state = prefill_with_prefixes(model, [ids], [b_split], capacity)
            self.prefix_states = {sample_key: (b_split, b_state)}
        elif setup == "B" and self.prefix_states.get(sample_key, (None,))[0] == split:
            state = self.prefix_states.pop(sample_key)[1]
        else:
            state = prefill(model, [prefix], capacity)
        for m in todo:
            desc = f"{length} {task}#{index}{setup} {m.label}"
            if forced:
                toks, stats, bud = self.decode(m, state, len(forced) + new, key, desc, (forced, None), then_sample=True)
                toks = toks[len(forced):]
            else:
                toks, stats, bud = self.decode(m, state, new, key, desc)
            pred = model.tokenizer.decode(toks)
            self.emit({**key, "seed": sample.seed, "units": sample.units, "outputs": list(sample.outputs),
                       "prediction": pred, "score": score(task, pred, sample.outputs), "question_tokens": len(forced),
                       "prefill_seconds": state.seconds,
                       **_record_fields(m, stats, len(prefix), model, s, _itemsize(state)), **bud})

    def likelihood(self, length: int, index: int) -> None:
        """A prose sample: dense prefill, then each method teacher-forced over the last tokens against dense."""
        from magicpig_jax.eval.likelihood import (
            LogitsRecorder,
            compare_to_dense,
            document_encoder,
            make_likelihood_sample,
        )
        from magicpig_jax.generation import prefill

        model, s = self.model, self.settings
        key = {"kind": "likelihood", "task": "prose", "length": length, "index": index, "setup": "A"}
        if not self.todo(key):
            return
        n = s.likelihood_tokens
        lik = make_likelihood_sample(document_encoder(model.tokenizer), length, index, seed=s.seed, haystack=s.haystack,
                                     forced=n)
        state = prefill(model, [lik.prefix], n - 1)
        rec_d = LogitsRecorder(n)
        _, dense_stats, dense_bud = self.decode(Method("dense", "dense"), state, n, key,
                                                f"{length} prose#{index} dense (reference)", (lik.targets, rec_d))
        logp_dense = rec_d.logp
        for m in self.todo(key):
            if m.backend == "dense":
                metrics = compare_to_dense(logp_dense, logp_dense, lik.targets)
                stats, bud = dense_stats, dense_bud
            else:
                rec_m = LogitsRecorder(n)
                _, stats, bud = self.decode(m, state, n, key, f"{length} prose#{index} {m.label}",
                                            (lik.targets, rec_m))
                metrics = compare_to_dense(rec_m.logp, logp_dense, lik.targets)
            rec = {**key, "seed": lik.seed, "paragraph": lik.paragraph, "forced_tokens": n,
                   "prefill_seconds": state.seconds, **metrics,
                   **_record_fields(m, stats, len(lik.prefix), model, s, _itemsize(state)), **bud}
            del rec["setup"]
            self.emit(rec)


def run_eval(model, settings: EvalSettings, out: Path, *, on_record: Callable[[dict], None] | None = None,
             progress: bool = True) -> ResultStore:
    """Run (or resume) the evaluation into ``out``; return the store with every record.

    Args:
      model: a :class:`magicpig_jax.io.loader.LoadedModel`.
      settings: what to run.
      out: output folder (created).
      on_record: called with each new record after it is written (tests use it to interrupt).
      progress: show tqdm bars.

    Raises:
      ValueError: ``out`` holds results of different settings (see ``config.json``), or a
        length exceeds the model's context.
    """
    from tqdm import tqdm

    out = Path(out)
    fp = settings.fingerprint(model)
    _check_before_writing(model, settings, fp["dense_layers"])
    out.mkdir(parents=True, exist_ok=True)
    unread = {k for k, readers in option_readers(settings.methods).items() if not readers}
    n_lik = settings.likelihood_documents
    if settings.likelihood_tokens == 0 or n_lik == 0:  # no likelihood document this run: its settings read nothing
        unread |= {"likelihood_tokens", "likelihood_starts", "likelihood_bos"}
    check_fingerprint(out, fp, FINGERPRINT_DEFAULTS, frozenset(unread))
    store = ResultStore(out / RESULTS)
    _check_config_files_unchanged(store, settings, out)
    t_start, n_before = time.time(), len(store.records)
    machine = machine_info()  # the checkout as the run starts (a commit during the run is not its source)
    loop = _Loop(model, settings, store, fp["dense_layers"], on_record, progress)
    units = _units(settings)
    labels = [m.label for m in settings.methods]
    pending = [u for u in units if any((*u[:4], lab, u[4]) not in store for lab in labels)]
    outer = tqdm(total=len(units), initial=len(units) - len(pending), desc="eval samples", unit="sample",
                 disable=None if progress else True)  # None: only on a terminal
    try:
        for kind, task, length, index, setup in pending:
            if kind == "task":
                loop.task(task, length, index, setup)
            else:
                loop.likelihood(length, index)
            release_compiled_programs()  # a long campaign compiles enough programs to exhaust the map limit
            outer.update(1)
    finally:
        outer.close()
        log_invocation(out, t_start, len(store.records) - n_before, machine)
    return store


# --- command line -------------------------------------------------------------------------------





def main(argv: list[str] | None = None) -> int:
    """Entry point of ``magicpig-jax eval``; returns the exit status (2 on bad input, 130 if interrupted).

    Bad input (``ValueError``, ``TypeError``, ``FileNotFoundError``) is reported on stderr, not raised.
    """
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
        from magicpig_jax.eval.corpus import load_prose
        from magicpig_jax.io.loader import load_model

        load_prose(settings.haystack)  # a bad --haystack fails here, before the model loads and --out is written
        from magicpig_jax.argparsing import check_output
        from magicpig_jax.io.loader import read_model_config

        check_output("--out", args.out, "dir")
        n_layers = read_model_config(args.model).num_layers
        bad = [i for i in settings.dense_layers or () if i >= n_layers]
        if bad:
            raise ValueError(f"--dense-layers {bad[0]} out of range: the model has {n_layers} layers "
                             f"(indices 0..{n_layers - 1})")

        model = load_model(args.model)
        print(f"model: {model.source} ({model.config.num_layers} layers); methods: "
              f"{', '.join(m.label for m in settings.methods)}; out: {args.out}", flush=True)
        try:
            store = run_eval(model, settings, args.out, progress=not args.no_progress)
        except KeyboardInterrupt:
            print(f"\ninterrupted: finished records are in {args.out / RESULTS}; rerun the same command to resume",
                  file=sys.stderr)
            return 130
        print(finish(store, settings, args.out, str(model.source), plot=not args.no_plot))
        print(f"wrote {args.out / 'summary.md'}" + ("" if args.no_plot else " and the PNG plots"))
        return 0
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"magicpig-jax: error: eval: {err}", file=sys.stderr)  # as the parser's errors
        return 2
    except FloatingPointError as err:  # NaN logits: stop rather than record a NaN the means would drop
        print(f"magicpig-jax: error: eval: {err}; finished records are in {args.out / RESULTS}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
