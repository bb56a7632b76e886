"""Reporting of ``magicpig-jax eval``: the per-length summary with 95% intervals, its markdown and the plots.

Accuracy is RULER's ``string_match_all``; KL, perplexity and top-1 agreement come from the
teacher-forced likelihood documents (:mod:`magicpig_jax.eval.likelihood`). Every figure is a
mean over independent samples and carries a 95% interval (:mod:`magicpig_jax.eval.stats`):
Wilson for a task whose scores are all 0 or 1, Student's t for fractional scores and for the
per-document KL, perplexity, top-1 agreement and ms per step, a stratified bootstrap for the
mean over tasks; differences to dense (accuracy) and to TopK (KL) are paired over samples.

Cost is reported three ways (:mod:`magicpig_jax.eval.cost`): the fraction of the context's keys
a method used per decode step in the sparse layers, the measured milliseconds per decode step,
and the bytes of K, V, index and page metadata a step reads. The plots put the quality figures
against the fraction of keys and against ms per step (Pareto charts, the non-dominated methods
joined by a line).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from magicpig_jax.eval.cost import BYTE_PARTS
from magicpig_jax.eval.stats import interval_for_scores, paired_t_interval, stratified_bootstrap_interval, t_interval
from magicpig_jax.eval.store import ResultStore, machine_info, read_runs

if TYPE_CHECKING:
    from magicpig_jax.eval.settings import EvalSettings

__all__ = ["summarize", "format_summary", "finish"]

_SHORT = {"niah_single": "NIAH-1", "niah_multikey": "NIAH-MK", "niah_multivalue": "NIAH-MV",
          "niah_multiquery": "NIAH-MQ", "vt": "VT", "cwe": "CWE", "fwe": "FWE"}


def _vals(xs: Sequence) -> list[float]:
    return [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]


def _mean(xs: Sequence) -> float | None:
    v = _vals(xs)
    return sum(v) / len(v) if v else None


def _ci(xs: Sequence) -> list[float | None]:
    lo, hi = t_interval(_vals(xs))
    return [lo, hi]


def _setups(settings) -> list[str]:
    return list(getattr(settings, "setups", None) or ["A"])


def _bytes(recs: list[dict]) -> tuple[float | None, dict]:
    parts = {p: _mean([(r.get("bytes_per_step") or {}).get(p) for r in recs]) for p in BYTE_PARTS}
    return _mean([(r.get("bytes_per_step") or {}).get("total") for r in recs]), parts


def _task_entry(task_recs: list[dict], dense_recs: list[dict], tasks: list[str], seed: int) -> dict:
    acc, acc_ci, how, n, diff = {}, {}, {}, {}, {}
    by_task = {t: [r for r in task_recs if r["task"] == t] for t in tasks}
    for t, rs in by_task.items():
        scores = [r["score"] for r in rs]
        acc[t] = _mean(scores)
        lo, hi, method = interval_for_scores(scores)
        acc_ci[t], how[t], n[t] = [lo, hi], method, len(scores)
        dense = {r["index"]: r["score"] for r in dense_recs if r["task"] == t}
        pairs = [(r["score"], dense[r["index"]]) for r in rs if r["index"] in dense]
        if pairs:
            d_lo, d_hi = paired_t_interval([a for a, _ in pairs], [b for _, b in pairs])
            diff[t] = [sum(a - b for a, b in pairs) / len(pairs), d_lo, d_hi]
        else:
            diff[t] = [None, None, None]
    groups = [[r["score"] for r in rs] for rs in by_task.values() if rs]
    mean_acc = _mean([a for a in acc.values() if a is not None])
    niah = [t for t in tasks if t.startswith("niah_") and acc.get(t) is not None]
    b_total, b_parts = _bytes(task_recs)
    return {
        "accuracy": acc, "accuracy_ci": acc_ci, "ci_method": how, "samples": n, "diff_vs_dense": diff,
        "mean_accuracy": mean_acc, "mean_accuracy_ci": list(stratified_bootstrap_interval(groups, seed=seed)),
        "needle_accuracy": _mean([acc[t] for t in niah]) if niah else None,
        "needle_accuracy_ci": list(stratified_bootstrap_interval([[r["score"] for r in by_task[t]] for t in niah],
                                                                 seed=seed)) if niah else [None, None],
        "cost": _mean([r["sampled_fraction"] for r in task_recs]),
        "ms_per_step": _mean([r.get("ms_per_step") for r in task_recs]),
        "ms_per_step_ci": _ci([r.get("ms_per_step") for r in task_recs]),
        "bytes_per_step": b_total, "bytes_per_step_parts": b_parts,
    }


def summarize(records: Sequence[dict], settings: EvalSettings) -> dict:
    """Aggregate records: ``{length: {method: {...}}}`` with means and 95% intervals.

    Only records of the requested tasks, lengths, methods, setups and sample indices count.
    Per method and length: ``tasks`` (per setup: ``accuracy``, ``accuracy_ci``, ``ci_method``,
    ``samples``, ``diff_vs_dense`` ``[mean, low, high]`` of the paired score difference,
    ``mean_accuracy`` (+ ``_ci``), ``needle_accuracy`` (+ ``_ci``, the NIAH tasks), ``cost``,
    ``ms_per_step`` (+ ``_ci``), ``bytes_per_step`` (+ ``_parts``)); from the likelihood
    documents ``kl``, ``ppl``, ``nll``, ``top1`` (each + ``_ci``), ``kl_minus_topk``
    ``[mean, low, high]`` (paired, against the first TopK method), ``likelihood_cost``,
    ``likelihood_ms_per_step`` (+ ``_ci``), ``likelihood_bytes_per_step`` (+ ``_parts``);
    over everything ``cost``, ``budget``, ``decode_tokens_per_s``; and the setup-A task figures
    at the top level (``accuracy``, ``mean_accuracy``, ...) as before setups existed.
    Costs are fractions (not percentages); a mean over no records is None.

    Args:
      records: the result records (:class:`magicpig_jax.eval.store.ResultStore` values).
      settings: what was asked for (:class:`magicpig_jax.eval.run.EvalSettings`).
    """
    labels = [m.label for m in settings.methods]
    topk = next((m.label for m in settings.methods if m.backend == "topk"), None)
    n_lik = settings.samples if settings.likelihood_samples is None else settings.likelihood_samples
    setups = _setups(settings)
    out: dict = {}
    for length in settings.lengths:
        per: dict = {}
        recs_of = {lab: [r for r in records if r["length"] == length and r["method"] == lab] for lab in labels}

        def task_recs(lab, setup, recs_of=recs_of):
            return [r for r in recs_of.get(lab, []) if r["kind"] == "task" and r["task"] in settings.tasks
                    and r["index"] < settings.samples and r.get("setup", "A") == setup]

        def lik_recs(lab, recs_of=recs_of):
            return [r for r in recs_of.get(lab, []) if r["kind"] == "likelihood" and r["index"] < n_lik]

        topk_kl = {r["index"]: r["kl"] for r in lik_recs(topk)} if topk else {}
        for lab in labels:
            lik = lik_recs(lab)
            tasks = {setup: _task_entry(task_recs(lab, setup), task_recs("dense", setup), settings.tasks,
                                        settings.seed) for setup in setups}
            pairs = [(r["kl"], topk_kl[r["index"]]) for r in lik if r["index"] in topk_kl]
            kl_topk = ([sum(a - b for a, b in pairs) / len(pairs),
                        *paired_t_interval([a for a, _ in pairs], [b for _, b in pairs])]
                       if pairs and lab != topk else [None, None, None])
            everything = [r for s in setups for r in task_recs(lab, s)] + lik
            b_total, b_parts = _bytes(lik)
            first = tasks[setups[0]]
            per[lab] = {
                "tasks": tasks,
                # setup-A (or first setup) figures at the top level
                "accuracy": first["accuracy"], "accuracy_ci": first["accuracy_ci"], "samples": first["samples"],
                "mean_accuracy": first["mean_accuracy"], "mean_accuracy_ci": first["mean_accuracy_ci"],
                "task_cost": {t: _mean([r["sampled_fraction"] for r in task_recs(lab, setups[0]) if r["task"] == t])
                              for t in settings.tasks},
                "cost": _mean([r["sampled_fraction"] for r in everything]),
                "likelihood_cost": _mean([r["sampled_fraction"] for r in lik]),
                "likelihood_ms_per_step": _mean([r.get("ms_per_step") for r in lik]),
                "likelihood_ms_per_step_ci": _ci([r.get("ms_per_step") for r in lik]),
                "likelihood_bytes_per_step": b_total, "likelihood_bytes_per_step_parts": b_parts,
                "kl": _mean([r["kl"] for r in lik]), "kl_ci": _ci([r["kl"] for r in lik]),
                "kl_minus_topk": kl_topk,
                "ppl": _mean([r["ppl"] for r in lik]), "ppl_ci": _ci([r["ppl"] for r in lik]),
                "nll": _mean([r["nll"] for r in lik]), "nll_ci": _ci([r["nll"] for r in lik]),
                "top1": _mean([r["top1"] for r in lik]), "top1_ci": _ci([r["top1"] for r in lik]),
                "likelihood_samples": len(lik),
                "budget": _mean([r.get("budget") for r in everything if isinstance(r.get("budget"), int)]),
                "decode_tokens_per_s": _mean([r["decode_tokens_per_s"] for r in everything]),
                "ms_per_step": _mean([r.get("ms_per_step") for r in everything]),
                "ms_per_step_ci": _ci([r.get("ms_per_step") for r in everything]),
            }
        out[length] = per
    return out


# --- markdown ---------------------------------------------------------------------------------

def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _with_ci(x, ci, fmt: str, scale: float = 1.0) -> str:
    if x is None:
        return "-"
    lo, hi = (ci or [None, None])[:2]
    core = format(scale * x, fmt)
    if lo is None or hi is None:
        return core
    return f"{core} [{format(scale * lo, fmt)}, {format(scale * hi, fmt)}]"


def _diff(d, fmt: str, scale: float = 1.0) -> str:
    if not d or d[0] is None:
        return "-"
    return _with_ci(d[0], d[1:], "+" + fmt if not fmt.startswith("+") else fmt, scale)


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def format_summary(summary: dict, settings: EvalSettings, header: str = "") -> str:
    """The markdown summary: per context length, a task table per setup and a likelihood table, then a legend.

    Args:
      summary: :func:`summarize`'s result.
      settings: the run's settings (task columns, setups, budget reference, likelihood tokens).
      header: markdown put before the tables.
    """
    from magicpig_jax.eval.settings import SETUPS

    lines = [header] if header else []
    setups = _setups(settings)
    if settings.tasks:
        lines.append("\nRULER setups of the task prompts: " + "; ".join(f"**{s}**: {SETUPS[s]}" for s in setups) + ".")
    for length, per in summary.items():
        lines.append(f"\n### Context {length} tokens\n")
        for setup in setups if settings.tasks else []:
            n_task = max((max(v["tasks"][setup]["samples"].values(), default=0) for v in per.values()), default=0)
            lines.append(f"\n#### Tasks, setup {setup} ({n_task} samples per task)\n")
            cols = [_SHORT.get(t, t) + " %" for t in settings.tasks]
            head = ["method", *cols, "mean %", "Δ vs dense (pp)", "keys %", "ms/step", "MB/step"]
            lines.append("| " + " | ".join(head) + " |")
            lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
            for lab, v in per.items():
                t = v["tasks"][setup]
                diffs = [d for d in t["diff_vs_dense"].values() if d and d[0] is not None]
                dcell = "; ".join(_diff(d, ".0f", 100) for d in t["diff_vs_dense"].values()) if diffs else "-"
                row = [lab, *[_with_ci(t["accuracy"][x], t["accuracy_ci"][x], ".0f", 100) for x in settings.tasks],
                       _with_ci(t["mean_accuracy"], t["mean_accuracy_ci"], ".1f", 100),
                       "-" if lab == "dense" else dcell, _pct(t["cost"], 2),
                       _with_ci(t["ms_per_step"], t["ms_per_step_ci"], ".1f"), _mb(t["bytes_per_step"])]
                lines.append("| " + " | ".join(row) + " |")
        n_lik = max((v["likelihood_samples"] for v in per.values()), default=0)
        if n_lik:
            lines.append(f"\n#### Likelihood ({n_lik} documents, {settings.likelihood_tokens} teacher-forced tokens "
                         "each)\n")
            head = ["method", "keys %", "budget", "ms/step", "MB/step (K / V / index / pages)", "KL",
                    "KL − TopK", "PPL", "top-1 %"]
            lines.append("| " + " | ".join(head) + " |")
            lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
            for lab, v in per.items():
                parts = v["likelihood_bytes_per_step_parts"]
                mb = (f"{_mb(v['likelihood_bytes_per_step'])} ("
                      + " / ".join(_mb(parts.get(p)) for p in BYTE_PARTS) + ")")
                row = [lab, _pct(v["likelihood_cost"], 2), _num(v["budget"], ".0f"),
                       _with_ci(v["likelihood_ms_per_step"], v["likelihood_ms_per_step_ci"], ".1f"), mb,
                       _with_ci(v["kl"], v["kl_ci"], ".4f"), _diff(v["kl_minus_topk"], ".4f"),
                       _with_ci(v["ppl"], v["ppl_ci"], ".2f"), _with_ci(v["top1"], v["top1_ci"], ".1f", 100)]
                lines.append("| " + " | ".join(row) + " |")
    lines.append(
        "\nEvery cell is a mean with its 95% interval in brackets. Accuracy: RULER's string_match_all (percent "
        "of expected strings in the answer) over the samples; interval: Wilson's when every score is 0 or 1, "
        "else Student's t; mean over tasks: stratified bootstrap (2000 resamples). Δ vs dense: the paired "
        "difference of scores to dense on the same samples (percentage points, t interval), per task. "
        "Keys %: mean fraction of the context's keys sampled (MagicPIG, hybrid), selected (TopK, Quest) or "
        "distinctly drawn (oracle) per decode step in the sparse layers, static set excluded (dense = 100%). "
        "ms/step: measured wall time of a decode step (after the first), t interval over samples; on a shared "
        "machine it drifts. MB/step: K, V, index and page-metadata bytes one step's attention reads at the "
        "method's best host implementation (magicpig_jax.eval.cost). Budget: mean keys per query head given "
        f"to TopK/Quest/oracle (the measured MagicPIG {settings.budget_from} count, rounded to "
        f"{settings.page_size}-token pages). KL: mean KL(dense || method) of the next-token distribution "
        f"over {settings.likelihood_tokens} teacher-forced prose tokens, t interval over documents; KL − TopK: "
        "paired difference to the first TopK method; PPL on those tokens; top-1: argmax agreement with dense.")
    return "\n".join(lines)


# --- plots ------------------------------------------------------------------------------------





















def finish(store: ResultStore, settings: EvalSettings, out: Path, model_source: str, plot: bool = True) -> str:
    """Write ``summary.md``, ``summary.json`` and (if ``plot``) the plots into ``out``; return the markdown.

    The header names the machine of the last invocation in ``runs.jsonl`` and the wall time of all of them.
    """
    out = Path(out)
    records = list(store.records.values())
    summary = summarize(records, settings)
    runs = read_runs(out)
    wall = sum(r["wall_seconds"] for r in runs)
    machine = runs[-1]["machine"] if runs else machine_info()
    header = (f"## magicpig-jax eval: {model_source}\n\n"
              f"Machine: {machine.get('cpu', machine.get('platform'))}, {machine.get('cpus')} CPUs, "
              f"devices {machine.get('devices')}, jax {machine.get('jax')}. Wall time over {len(runs)} "
              f"invocation(s): {wall / 3600:.2f} h. Records: {len(records)}. Haystack: {settings.haystack}; "
              f"static set {settings.num_sink} sink + {settings.num_local} local; seed {settings.seed}.")
    text = format_summary(summary, settings, header)
    (out / "summary.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps({"setups": _setups(settings),
                                                  **{str(k): v for k, v in summary.items()}}, indent=2) + "\n")
    if plot:
        from magicpig_jax.eval.plots import write_plots

        write_plots(summary, settings, out)
    return text
