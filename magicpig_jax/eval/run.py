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
``topk`` / ``quest`` / ``oracle``
                        exact TopK, Quest (``--page-size`` pages), oracle sampling
                        (Definition 3.1), each with a per-sample budget equal to the *measured*
                        mean number of keys the ``--budget-from`` method (default
                        ``magicpig:10x150``) sampled on the same sample, rounded to a multiple
                        of ``--page-size`` (at least one page; the rounding bounds the number
                        of distinct jit compilations). The reference method is run first (it
                        is added to the list if missing). ``topk:N`` / ``topk:0.02`` fix the
                        budget instead (tokens / fraction of the middle range).

Work: for each length, sample index and task a RULER-style sample
(:mod:`magicpig_jax.eval.tasks`) is generated to fill ``length`` tokens (prompt + new
tokens, chat template applied), prefilled once and decoded greedily by each method; the
answer is scored as RULER does. Unless ``--likelihood-tokens 0``, each length also gets
``--likelihood-samples`` prose samples (:mod:`magicpig_jax.eval.likelihood`): dense
prefill of all but the last N tokens, then teacher-forced decoding of those N by each method:
perplexity, KL(dense || method), top-1 agreement.

Outputs in ``--out``:

* ``results.jsonl`` — one JSON record per (sample, method), appended and fsync'ed as soon as
  it is computed. A rerun of the same command skips every record already there, so an
  interrupted run resumes where it stopped and loses nothing (a partially written last line
  is dropped). ``config.json`` pins the settings that make records comparable (model,
  haystack, seed, static set, dense layers, new tokens, ...): a rerun with different ones
  is refused. ``runs.jsonl`` logs every invocation (machine, wall time, records added).
* ``summary.md`` — per length: accuracy per task and method, mean accuracy, cost (mean
  fraction of the context's keys sampled/selected per decode step in the sparse layers;
  dense = 100%), KL, perplexity, top-1 agreement; printed as well. ``summary.json`` has
  the same numbers.
* ``accuracy_vs_cost.png`` (one panel per task, plus the mean) and ``kl_vs_cost.png``
  (matplotlib).

Example (the documented full run; see ``examples/results/README.md``)::

    magicpig-jax eval --tasks all --lengths 2K,4K,8K --samples 2 --likelihood-samples 1 \\
        --methods dense,magicpig:8x75,magicpig:10x150,magicpig:10x170,magicpig:11x300,topk,quest,oracle \\
        --out examples/results/eval
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "main",
    "make_parser",
    "Method",
    "parse_methods",
    "parse_lengths",
    "EvalSettings",
    "ResultStore",
    "run_eval",
    "summarize",
    "format_summary",
    "write_plots",
    "prompt_ids",
    "DEFAULT_METHODS",
]

DEFAULT_METHODS = "dense,magicpig:8x75,magicpig:10x150,magicpig:10x170,magicpig:11x300,topk,quest,oracle"
RESULTS = "results.jsonl"


# --- methods ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Method:
    """An attention method of the comparison.

    Attributes:
      label: its name in results and tables (``dense``, ``magicpig:10x150``, ``topk``, ``topk:160``).
      backend: the :data:`magicpig_jax.models.backends.BACKENDS` entry.
      K, L: MagicPIG's bits and tables (``magicpig`` only).
      budget: a fixed budget (int tokens or float fraction) for topk/quest/oracle, or None =
        measured from the reference MagicPIG method on each sample.
    """

    label: str
    backend: str
    K: int | None = None
    L: int | None = None
    budget: int | float | None = None

    @property
    def budgeted(self) -> bool:
        return self.backend in ("topk", "quest", "oracle")


def _parse_method(text: str) -> Method:
    from magicpig_jax.lsh import validate_k_l

    name, _, arg = text.strip().partition(":")
    name = name.strip().lower()
    if name == "dense":
        if arg:
            raise ValueError(f"dense takes no argument, got {text!r}")
        return Method("dense", "dense")
    if name in ("magicpig", "magicpig-ref"):
        arg = arg or "10x150"
        try:
            k, l_ = (int(x) for x in arg.lower().split("x"))
        except ValueError as err:
            raise ValueError(f"{name} takes KxL (e.g. {name}:10x150), got {text!r}") from err
        validate_k_l(k, l_)
        return Method(f"{name}:{k}x{l_}", name, K=k, L=l_)
    if name in ("topk", "quest", "oracle"):
        if not arg:
            return Method(name, name)
        try:
            budget: int | float = int(arg) if arg.isdigit() else float(arg)
        except ValueError as err:
            raise ValueError(f"{name} takes a budget in tokens or a fraction, got {text!r}") from err
        if (isinstance(budget, int) and budget < 1) or (isinstance(budget, float) and not 0 < budget <= 1):
            raise ValueError(f"{name} budget must be >= 1 tokens or a fraction in (0, 1], got {arg!r}")
        return Method(f"{name}:{arg}", name, budget=budget)
    raise ValueError(f"unknown method {text!r}; methods: dense, magicpig[:KxL], magicpig-ref[:KxL], topk[:B], "
                     "quest[:B], oracle[:B]")


def parse_methods(text: str, budget_from: str = "magicpig:10x150") -> list[Method]:
    """Parse ``--methods``; order: dense, MagicPIG (the budget reference first), the budgeted ones.

    The reference ``budget_from`` method is added when a budgeted method needs it.

    Raises:
      ValueError: an unknown or malformed method, or a duplicate.
    """
    methods = [_parse_method(x) for x in text.split(",") if x.strip()]
    if not methods:
        raise ValueError("--methods is empty")
    labels = [m.label for m in methods]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"duplicate methods: {dup}")
    ref = _parse_method(budget_from)
    if not ref.backend.startswith("magicpig"):
        raise ValueError(f"--budget-from must be a magicpig:KxL method, got {budget_from!r}")
    if any(m.budgeted and m.budget is None for m in methods) and ref.label not in labels:
        methods.append(ref)
    rank = {"dense": 0, "magicpig": 1, "magicpig-ref": 1, "topk": 2, "quest": 3, "oracle": 4}
    return sorted(methods, key=lambda m: (rank[m.backend], m.label != ref.label))


def parse_lengths(text: str) -> list[int]:
    """``2K,4K,8K`` or ``2048,4096`` -> token counts (K = 1024).

    Raises:
      ValueError: a malformed or non-positive length.
    """
    out = []
    for x in (x.strip() for x in text.split(",")):
        if not x:
            continue
        try:
            n = int(float(x[:-1]) * 1024) if x[-1] in "kK" else int(x)
        except ValueError as err:
            raise ValueError(f"bad length {x!r} (use e.g. 2K,4K,8K or 2048)") from err
        if n < 64:
            raise ValueError(f"length must be >= 64 tokens, got {x!r}")
        out.append(n)
    if not out:
        raise ValueError("--lengths is empty")
    return out


# --- settings, storage --------------------------------------------------------------------------

@dataclasses.dataclass
class EvalSettings:
    """What to run (see :func:`make_parser` for the meaning of each field)."""

    tasks: list[str]
    lengths: list[int]
    samples: int
    methods: list[Method]
    haystack: str = "jargon"
    seed: int = 0
    likelihood_tokens: int = 256
    likelihood_samples: int | None = None
    max_new_tokens: int | None = None
    num_sink: int = 4
    num_local: int = 64
    dense_layers: list[int] | None = None
    budget_from: str = "magicpig:10x150"
    page_size: int = 16

    def fingerprint(self, model) -> dict:
        """The settings every record of one results file must share."""
        from magicpig_jax.models.config import default_dense_layers

        n = model.config.num_layers
        dl = sorted(set(default_dense_layers(n) if self.dense_layers is None else self.dense_layers))
        return {"model": str(model.source), "haystack": self.haystack, "seed": self.seed,
                "num_sink": self.num_sink, "num_local": self.num_local, "dense_layers": dl,
                "max_new_tokens": self.max_new_tokens, "likelihood_tokens": self.likelihood_tokens,
                "budget_from": self.budget_from, "page_size": self.page_size}


def record_key(rec: dict) -> tuple:
    """The identity of a record: (kind, task, length, index, method)."""
    return (rec["kind"], rec["task"], int(rec["length"]), int(rec["index"]), rec["method"])


class ResultStore:
    """The append-only JSONL results file, crash-safe.

    Loading drops a partially written last line (no trailing newline, or not valid JSON)
    by truncating the file to the last complete record; later duplicates of a key are
    ignored. :meth:`append` writes one line, flushes and fsyncs it.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.records: dict[tuple, dict] = {}
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        keep = len(data)
        lines = data.split(b"\n")
        if data and not data.endswith(b"\n"):
            keep -= len(lines[-1])
            lines = lines[:-1]
        good = 0
        for raw in lines:
            if not raw.strip():
                good += len(raw) + 1
                continue
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError:
                keep = good  # a corrupt line: drop it and everything after it
                break
            self.records.setdefault(record_key(rec), rec)
            good += len(raw) + 1
        if keep < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(keep)

    def __contains__(self, key: tuple) -> bool:
        return key in self.records

    def get(self, key: tuple) -> dict | None:
        return self.records.get(key)

    def append(self, rec: dict) -> None:
        key = record_key(rec)
        if key in self.records:
            raise RuntimeError(f"duplicate record {key}")
        line = json.dumps(rec, sort_keys=True) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.records[key] = rec


def machine_info() -> dict:
    """The machine a run happened on (for the results' provenance)."""
    import jax

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "jax": jax.__version__, "devices": [str(d) for d in jax.devices()]}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


# --- the run ------------------------------------------------------------------------------------

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
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) + answer_prefix
    return encode_prompt(model, text, chat=False)


def _budget_tokens(ref: dict | None, page: int) -> tuple[int, float | None]:
    """The budget from the reference record: its mean sampled keys, rounded to pages."""
    if ref is None or ref.get("mean_sampled_keys") is None:
        return page, None
    keys = float(ref["mean_sampled_keys"])
    return max(page, int(round(keys / page)) * page), keys


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
      ValueError: ``out`` holds results of different settings (see ``config.json``).
    """
    from tqdm import tqdm

    from magicpig_jax.attention import MagicPIGConfig
    from magicpig_jax.eval.likelihood import LogitsRecorder, compare_to_dense, make_likelihood_sample
    from magicpig_jax.eval.tasks import make_sample, score
    from magicpig_jax.generation import decode, prefill

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fp = settings.fingerprint(model)
    cfg_path = out / "config.json"
    if cfg_path.exists():
        old = json.loads(cfg_path.read_text())
        diff = {k: (old.get("fingerprint", {}).get(k), v) for k, v in fp.items()
                if old.get("fingerprint", {}).get(k) != v}
        if diff:
            raise ValueError(f"{out} holds results of other settings {diff} (old, new); use another --out")
    else:
        cfg_path.write_text(json.dumps({"fingerprint": fp}, indent=2) + "\n")
    store = ResultStore(out / RESULTS)
    t_start, n_before = time.time(), len(store.records)
    ctx_limit = model.config.max_position_embeddings
    for length in settings.lengths:
        if length > ctx_limit:
            raise ValueError(f"length {length} exceeds the model's context of {ctx_limit} tokens")
    ref_label = _parse_method(settings.budget_from).label
    dense_layers = fp["dense_layers"]

    def mp_config(m: Method) -> MagicPIGConfig:
        return MagicPIGConfig(K=m.K or 10, L=m.L or 150, num_sink=settings.num_sink,
                              num_local=settings.num_local, seed=settings.seed)

    def run_method(m: Method, state, n_new: int, key_base: dict, desc: str, **kw):
        """Decode with method m; return (token ids, stats, budget fields)."""
        budget, measured = m.budget, None
        if m.budgeted and budget is None:
            ref = store.get((key_base["kind"], key_base["task"], key_base["length"], key_base["index"], ref_label))
            budget, measured = _budget_tokens(ref, settings.page_size)
        bar = tqdm(total=max(n_new - 1, 0), desc=desc, unit="tok", leave=False, disable=not progress)
        try:
            outs, stats = decode(model, state, attention=m.backend, max_new_tokens=n_new, config=mp_config(m),
                                 dense_layers=dense_layers, seed=settings.seed, budget=budget,
                                 page_size=settings.page_size, progress=bar.update, **kw)
        finally:
            bar.close()
        return outs[0], stats, {"budget": budget, "budget_measured_keys": measured}

    def base_fields(m: Method, stats: dict, prompt_tokens: int) -> dict:
        steps = stats["decode_steps"]
        frac = stats["sampled_fraction"]
        mean_keys = None if frac is None else frac * (prompt_tokens + 1 + max(steps - 1, 0) / 2)
        return {"method": m.label, "backend": m.backend, "K": m.K, "L": m.L,
                "prompt_tokens": prompt_tokens, "sampled_fraction": 1.0 if m.backend == "dense" else frac,
                "sampled_fraction_per_layer": stats["sampled_fraction_per_layer"],
                "mean_sampled_keys": mean_keys, "decode_steps": steps, "decode_tokens": stats["decode_tokens"],
                "decode_seconds": stats["decode_seconds"], "decode_tokens_per_s": stats["decode_tokens_per_s"],
                "compile_seconds": stats["compile_seconds"], "index_build_seconds": stats["index_build_seconds"],
                "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}

    def emit(rec: dict) -> None:
        store.append(rec)
        if on_record is not None:
            on_record(rec)

    units: list[tuple[str, str, int, int]] = []
    for length in settings.lengths:
        for index in range(settings.samples):
            units.extend(("task", task, length, index) for task in settings.tasks)
        if settings.likelihood_tokens > 0:
            n_lik = settings.samples if settings.likelihood_samples is None else settings.likelihood_samples
            units.extend(("likelihood", "prose", length, index) for index in range(n_lik))
    labels = [m.label for m in settings.methods]
    pending = [u for u in units if any((*u, lab) not in store for lab in labels)]
    outer = tqdm(total=len(units), initial=len(units) - len(pending), desc="eval samples", unit="sample",
                 disable=not progress)
    try:
        for kind, task, length, index in pending:
            todo = [m for m in settings.methods if (kind, task, length, index, m.label) not in store]
            key_base = {"kind": kind, "task": task, "length": length, "index": index}
            if kind == "task":
                sample = make_sample(task, length, index, lambda p, a: len(prompt_ids(model, p, a)),
                                     seed=settings.seed, haystack=settings.haystack,
                                     max_new_tokens=settings.max_new_tokens)
                ids = prompt_ids(model, sample.prompt, sample.answer_prefix)
                # capacity = round_up(length): every sample of a length shares the jit compilations
                state = prefill(model, [ids], max(length - len(ids) - 1, sample.max_new_tokens))
                for m in todo:
                    desc = f"{length} {task}#{index} {m.label}"
                    toks, stats, bud = run_method(m, state, sample.max_new_tokens, key_base, desc)
                    pred = model.tokenizer.decode(toks)
                    rec = {**key_base, "seed": sample.seed, "units": sample.units, "outputs": list(sample.outputs),
                           "prediction": pred, "score": score(task, pred, sample.outputs),
                           "prefill_seconds": state.seconds, **base_fields(m, stats, len(ids)), **bud}
                    emit(rec)
            else:
                n = settings.likelihood_tokens
                lik = make_likelihood_sample(model.tokenizer.encode, length, index, seed=settings.seed,
                                             haystack=settings.haystack, forced=n)
                state = prefill(model, [lik.prefix], n - 1)
                dense = Method("dense", "dense")
                rec_d = LogitsRecorder(n)
                _, dense_stats, dense_bud = run_method(dense, state, n, key_base,
                                                       f"{length} prose#{index} dense (reference)",
                                                       forced_tokens=[lik.targets], logits_callback=rec_d,
                                                       stop_on_eos=False)
                logp_dense = rec_d.logp
                for m in todo:
                    if m.backend == "dense":
                        metrics = compare_to_dense(logp_dense, logp_dense, lik.targets)
                        stats, bud = dense_stats, dense_bud
                    else:
                        rec_m = LogitsRecorder(n)
                        toks, stats, bud = run_method(m, state, n, key_base, f"{length} prose#{index} {m.label}",
                                                      forced_tokens=[lik.targets], logits_callback=rec_m,
                                                      stop_on_eos=False)
                        metrics = compare_to_dense(rec_m.logp, logp_dense, lik.targets)
                    rec = {**key_base, "seed": lik.seed, "paragraph": lik.paragraph, "forced_tokens": n,
                           "prefill_seconds": state.seconds, **metrics,
                           **base_fields(m, stats, len(lik.prefix)), **bud}
                    emit(rec)
            del state
            outer.update(1)
    finally:
        outer.close()
        wall = time.time() - t_start
        added = len(store.records) - n_before
        if added or wall > 1:
            entry = {"start": datetime.datetime.fromtimestamp(t_start, datetime.UTC).isoformat(timespec="seconds"),
                     "wall_seconds": round(wall, 1), "records_added": added, "machine": machine_info(),
                     "argv": sys.argv}
            with open(out / "runs.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
    return store


# --- summary ------------------------------------------------------------------------------------

def _mean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def summarize(records: Sequence[dict], settings: EvalSettings) -> dict:
    """Aggregate records: ``{length: {method: {...}}}`` with per-task accuracy, cost, KL, PPL.

    Only records of the requested tasks, lengths, methods and sample indices count.
    Cost = mean ``sampled_fraction`` over the method's task and likelihood records.
    """
    labels = [m.label for m in settings.methods]
    n_lik = settings.samples if settings.likelihood_samples is None else settings.likelihood_samples
    out: dict = {}
    for length in settings.lengths:
        per: dict = {}
        for lab in labels:
            recs = [r for r in records if r["length"] == length and r["method"] == lab]
            task_recs = [r for r in recs if r["kind"] == "task" and r["task"] in settings.tasks
                         and r["index"] < settings.samples]
            lik_recs = [r for r in recs if r["kind"] == "likelihood" and r["index"] < n_lik]
            acc = {t: _mean([r["score"] for r in task_recs if r["task"] == t]) for t in settings.tasks}
            n = {t: sum(1 for r in task_recs if r["task"] == t) for t in settings.tasks}
            per[lab] = {
                "accuracy": acc, "samples": n,
                "mean_accuracy": _mean([a for a in acc.values() if a is not None]),
                "cost": _mean([r["sampled_fraction"] for r in task_recs + lik_recs]),
                "task_cost": {t: _mean([r["sampled_fraction"] for r in task_recs if r["task"] == t])
                              for t in settings.tasks},
                "likelihood_cost": _mean([r["sampled_fraction"] for r in lik_recs]),
                "kl": _mean([r["kl"] for r in lik_recs]), "ppl": _mean([r["ppl"] for r in lik_recs]),
                "nll": _mean([r["nll"] for r in lik_recs]), "top1": _mean([r["top1"] for r in lik_recs]),
                "likelihood_samples": len(lik_recs),
                "budget": _mean([r.get("budget") for r in task_recs + lik_recs
                                 if isinstance(r.get("budget"), int)]),
                "decode_tokens_per_s": _mean([r["decode_tokens_per_s"] for r in task_recs + lik_recs]),
            }
        out[length] = per
    return out


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_summary(summary: dict, settings: EvalSettings, header: str = "") -> str:
    """The markdown summary: one table per context length."""
    lines = [header] if header else []
    short = {"niah_single": "NIAH-1", "niah_multikey": "NIAH-MK", "niah_multivalue": "NIAH-MV",
             "niah_multiquery": "NIAH-MQ", "vt": "VT", "cwe": "CWE", "fwe": "FWE"}
    for length, per in summary.items():
        n_task = max((max(v["samples"].values(), default=0) for v in per.values()), default=0)
        n_lik = max((v["likelihood_samples"] for v in per.values()), default=0)
        lines.append(f"\n### Context {length} tokens ({n_task} samples per task, {n_lik} likelihood samples)\n")
        cols = [short.get(t, t) for t in settings.tasks]
        head = ["method", *cols, "mean acc %", "cost %", "budget", "KL", "PPL", "top-1 %", "tok/s"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
        for lab, v in per.items():
            row = [lab, *[_pct(v["accuracy"][t], 0) for t in settings.tasks], _pct(v["mean_accuracy"]),
                   _pct(v["cost"], 2), _num(v["budget"], ".0f"), _num(v["kl"], ".4f"), _num(v["ppl"], ".2f"),
                   _pct(v["top1"]), _num(v["decode_tokens_per_s"], ".2f")]
            lines.append("| " + " | ".join(row) + " |")
    lines.append(
        "\nAccuracy: RULER's string_match_all (percent of expected strings in the answer), mean over samples. "
        "Cost: mean fraction of the context's keys sampled (MagicPIG), selected (TopK, Quest) or distinctly drawn "
        "(oracle) per decode step in the sparse layers, static set excluded (dense = 100%). Budget: mean keys per "
        "query head given to TopK/Quest/oracle (the measured MagicPIG "
        f"{settings.budget_from} count, rounded to {settings.page_size}-token pages). KL: mean KL(dense || method) "
        f"of the next-token distribution over {settings.likelihood_tokens} teacher-forced prose tokens; PPL on "
        "those tokens; top-1: argmax agreement with dense. tok/s: decode tokens per second on this machine "
        "(magicpig: the host op on a CPU backend; dense, TopK, Quest, oracle, magicpig-ref: pure JAX).")
    return "\n".join(lines)


_MARKERS = "os^Dv<>P*X"


def _plain_log_ticks(axis) -> None:
    """Log-scale ticks written as plain numbers (2, 5, 10, 100) instead of 2x10^0."""
    from matplotlib.ticker import FuncFormatter

    def minor(x, _):
        mantissa = x / 10 ** math.floor(math.log10(x)) if x > 0 else 0
        return f"{x:g}" if round(mantissa) in (2, 5) and abs(mantissa - round(mantissa)) < 1e-6 else ""

    axis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    axis.set_minor_formatter(FuncFormatter(minor))


def write_plots(summary: dict, settings: EvalSettings, out: Path) -> list[Path]:
    """``accuracy_vs_cost.png`` and ``kl_vs_cost.png`` (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    labels = [m.label for m in settings.methods]
    colors = {lab: plt.get_cmap("tab10")(i % 10) for i, lab in enumerate(labels)}
    marker = {length: _MARKERS[i % len(_MARKERS)] for i, length in enumerate(summary)}
    written = []
    panels = [*settings.tasks, "mean"] if settings.tasks else []
    if panels:
        ncol = min(4, len(panels))
        nrow = math.ceil(len(panels) / ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.4 * nrow), squeeze=False)
        for ax, task in zip(axes.flat, panels, strict=False):
            for length, per in summary.items():
                for lab, v in per.items():
                    acc = v["mean_accuracy"] if task == "mean" else v["accuracy"].get(task)
                    cost = v["cost"] if task == "mean" else v["task_cost"].get(task)
                    if acc is None or cost is None:
                        continue
                    ax.scatter([100 * cost], [100 * acc], color=colors[lab], marker=marker[length], s=40,
                               alpha=0.85)
            ax.set_xscale("log")
            _plain_log_ticks(ax.xaxis)
            ax.set_title(task)
            ax.set_xlabel("cost: keys touched per step (%)")
            ax.set_ylabel("accuracy (%)")
            ax.set_ylim(-5, 105)
            ax.grid(alpha=0.3, which="both")
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        _legend(fig, colors, marker)
        fig.suptitle("Task accuracy versus attention cost (same prefill, same static set)")
        fig.tight_layout(rect=(0, 0, 0.83, 0.95))
        path = out / "accuracy_vs_cost.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if any(v["kl"] is not None for per in summary.values() for v in per.values()):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for length, per in summary.items():
            for lab, v in per.items():
                if v["kl"] is None or v["likelihood_cost"] is None or lab == "dense":
                    continue
                ax.scatter([100 * v["likelihood_cost"]], [max(v["kl"], 1e-6)], color=colors[lab],
                           marker=marker[length], s=50)
        ax.set_xscale("log")
        ax.set_yscale("log")
        _plain_log_ticks(ax.xaxis)
        ax.set_xlabel("cost: keys touched per step (%)")
        ax.set_ylabel("mean KL(dense || method) (nats)")
        ax.set_title(f"Next-token KL from dense over {settings.likelihood_tokens} teacher-forced tokens")
        ax.grid(alpha=0.3, which="both")
        _legend(fig, {k: c for k, c in colors.items() if k != "dense"}, marker)
        fig.tight_layout(rect=(0, 0, 0.75, 1))
        path = out / "kl_vs_cost.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _legend(fig, colors: dict, marker: dict) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, marker="o", linestyle="", label=lab) for lab, c in colors.items()]
    handles += [Line2D([], [], color="gray", marker=mk, linestyle="", label=f"{length} tokens")
                for length, mk in marker.items()]
    fig.legend(handles=handles, loc="center right", fontsize=8, frameon=False)


# --- command line -------------------------------------------------------------------------------

def make_parser() -> argparse.ArgumentParser:
    """The argument parser of ``magicpig-jax eval``."""
    from magicpig_jax.eval.tasks import TASKS

    p = argparse.ArgumentParser(prog="magicpig-jax eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="all",
                   help=f"comma-separated tasks ({', '.join(TASKS)}; 'all', 'niah', or 'none' for likelihood only)")
    p.add_argument("--lengths", default="2K,4K,8K", help="context lengths in tokens (prompt + new tokens)")
    p.add_argument("--samples", type=int, default=4, help="samples per task and length")
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated methods (default: {DEFAULT_METHODS})")
    p.add_argument("--out", type=Path, required=True, help="output folder (results.jsonl, summary.md, PNGs)")
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: embedded SmolLM2)")
    p.add_argument("--haystack", default="jargon",
                   help="prose: jargon (Debian jargon-text), licenses (/usr/share/common-licenses) or a text file")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples, LSH projections and oracle sampling")
    p.add_argument("--likelihood-tokens", type=int, default=256,
                   help="teacher-forced prose tokens per likelihood sample (0 = no likelihood)")
    p.add_argument("--likelihood-samples", type=int, default=None, help="prose samples per length (default --samples)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens for every task (default: per task)")
    p.add_argument("--num-sink", type=int, default=4)
    p.add_argument("--num-local", type=int, default=64)
    p.add_argument("--dense-layers", default=None, help="layers kept dense (default: 0 and num_layers // 2)")
    p.add_argument("--budget-from", default="magicpig:10x150",
                   help="MagicPIG method whose measured sampled count is the TopK/Quest/oracle budget")
    p.add_argument("--page-size", type=int, default=16, help="Quest page size; budgets are rounded to it")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    return p


def settings_from_args(args) -> EvalSettings:
    """Validate parsed arguments into :class:`EvalSettings` (raises ValueError with the reason)."""
    from magicpig_jax.eval.tasks import parse_tasks

    tasks = [] if args.tasks.strip().lower() == "none" else parse_tasks(args.tasks)
    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    if args.likelihood_tokens < 0 or (args.likelihood_samples is not None and args.likelihood_samples < 0):
        raise ValueError("--likelihood-tokens and --likelihood-samples must be >= 0")
    if not tasks and args.likelihood_tokens == 0:
        raise ValueError("nothing to do: --tasks none and --likelihood-tokens 0")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.page_size < 1:
        raise ValueError(f"--page-size must be >= 1, got {args.page_size}")
    dense_layers = None
    if args.dense_layers is not None:
        try:
            dense_layers = [int(x) for x in args.dense_layers.split(",") if x.strip()]
        except ValueError as err:
            raise ValueError(f"--dense-layers takes comma-separated integers, got {args.dense_layers!r}") from err
    return EvalSettings(tasks=tasks, lengths=parse_lengths(args.lengths), samples=args.samples,
                        methods=parse_methods(args.methods, args.budget_from), haystack=args.haystack,
                        seed=args.seed, likelihood_tokens=args.likelihood_tokens,
                        likelihood_samples=args.likelihood_samples, max_new_tokens=args.max_new_tokens,
                        num_sink=args.num_sink, num_local=args.num_local, dense_layers=dense_layers,
                        budget_from=args.budget_from, page_size=args.page_size)


def finish(store: ResultStore, settings: EvalSettings, out: Path, model_source: str, plot: bool = True) -> str:
    """Write ``summary.md``, ``summary.json`` and the plots; return the markdown."""
    out = Path(out)
    records = list(store.records.values())
    summary = summarize(records, settings)
    runs = []
    if (out / "runs.jsonl").exists():
        runs = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines() if x.strip()]
    wall = sum(r["wall_seconds"] for r in runs)
    machine = runs[-1]["machine"] if runs else machine_info()
    header = (f"## magicpig-jax eval: {model_source}\n\n"
              f"Machine: {machine.get('cpu', machine.get('platform'))}, {machine.get('cpus')} CPUs, "
              f"devices {machine.get('devices')}, jax {machine.get('jax')}. Wall time over {len(runs)} "
              f"invocation(s): {wall / 3600:.2f} h. Records: {len(records)}. Haystack: {settings.haystack}; "
              f"static set {settings.num_sink} sink + {settings.num_local} local; seed {settings.seed}.")
    text = format_summary(summary, settings, header)
    (out / "summary.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps({str(k): v for k, v in summary.items()}, indent=2) + "\n")
    if plot:
        write_plots(summary, settings, out)
    return text


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``magicpig-jax eval``; returns the exit status (2 on bad input, 130 if interrupted)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
        from magicpig_jax.io.loader import load_model

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
        print(f"magicpig-jax eval: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
