"""Reporting of ``magicpig-jax eval``: the per-length summary with 95% intervals, its markdown and the plots.

Accuracy is RULER's ``string_match_all``; KL, perplexity and top-1 agreement come from the
teacher-forced likelihood documents (:mod:`magicpig_jax.eval.likelihood`). Every figure is a
mean over independent samples and carries a 95% interval (:mod:`magicpig_jax.eval.stats`):
Wilson for a task's scores (at their mean when they are fractions), Student's t for the
per-document KL, perplexity, top-1 agreement and ms per step, Wilson's at an effective size for the
mean over tasks; differences to dense (accuracy: Newcombe's) and to TopK (KL: t) are paired over samples.

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
from magicpig_jax.eval.stats import (
    effective_size_wilson_interval,
    interval_for_scores,
    newcombe_paired_interval,
    paired_t_interval,
    sign_test,
    t_interval,
)
from magicpig_jax.eval.store import ResultStore, machine_info, read_runs

if TYPE_CHECKING:
    from magicpig_jax.eval.settings import EvalSettings

__all__ = ["summarize", "format_summary", "finish", "equal_ms_comparison", "topk_reference"]

_SHORT = {"niah_single": "NIAH-1", "niah_multikey": "NIAH-MK", "niah_multivalue": "NIAH-MV",
          "niah_multiquery": "NIAH-MQ", "vt": "VT", "cwe": "CWE", "fwe": "FWE"}


def _vals(xs: Sequence) -> list[float]:
    """The values that are there (None: not measured, e.g. a step not timed). A NaN stays: it is a
    broken measurement, and a mean that dropped it would look whole."""
    return [float(x) for x in xs if x is not None]


def _mean(xs: Sequence) -> float | None:
    v = _vals(xs)
    return sum(v) / len(v) if v else None


def _exp(x: float | None) -> float | None:
    return None if x is None else math.exp(x)


def _ci(xs: Sequence, bounds: tuple[float, float] = (0.0, math.inf)) -> list[float | None]:
    """t interval of the mean, clipped to ``bounds``: every quantity it serves (ms, KL,
    perplexity, NLL, agreement) cannot leave them, and a t interval over few samples would.
    NaN when a value is NaN or infinite (the mean is then NaN or infinite)."""
    v = _vals(xs)
    if not all(math.isfinite(x) for x in v):  # t_interval drops NaN and inf: the interval would look whole
        return [math.nan, math.nan]
    lo, hi = t_interval(v)
    if lo is None or hi is None:
        return [lo, hi]
    return [max(lo, bounds[0]), min(hi, bounds[1])]


def _setups(settings) -> list[str]:
    return list(getattr(settings, "setups", None) or ["A"])


def _bytes(recs: list[dict]) -> tuple[float | None, dict]:
    parts = {p: _mean([(r.get("bytes_per_step") or {}).get(p) for r in recs]) for p in BYTE_PARTS}
    return _mean([(r.get("bytes_per_step") or {}).get("total") for r in recs]), parts


def _paired_scores(pairs: list[tuple[float, float]]) -> tuple[list, str | None]:
    """``[mean, low, high]`` of the paired score difference and the interval's method: Newcombe's
    (``"newcombe"`` when every score is 0 or 1, ``"newcombe-mean"`` at the means of fractional
    scores: :func:`~magicpig_jax.eval.stats.newcombe_paired_interval`)."""
    if not pairs:
        return [None, None, None], None
    xs, ys = [a for a, _ in pairs], [b for _, b in pairs]
    mean = sum(a - b for a, b in pairs) / len(pairs)
    how = "newcombe" if all(v in (0, 1) for v in (*xs, *ys)) else "newcombe-mean"
    return [mean, *newcombe_paired_interval(xs, ys)], how


def _task_entry(task_recs: list[dict], dense_recs: list[dict], tasks: list[str]) -> dict:
    acc, acc_ci, how, n, diff, diff_how = {}, {}, {}, {}, {}, {}
    by_task = {t: [r for r in task_recs if r["task"] == t] for t in tasks}
    for t, rs in by_task.items():
        scores = [r["score"] for r in rs]
        acc[t] = _mean(scores)
        lo, hi, method = interval_for_scores(scores)
        acc_ci[t], how[t], n[t] = [lo, hi], method, len(scores)
        dense = {r["index"]: r["score"] for r in dense_recs if r["task"] == t}
        pairs = [(r["score"], dense[r["index"]]) for r in rs if r["index"] in dense]
        diff[t], diff_how[t] = _paired_scores(pairs)
    groups = [[r["score"] for r in rs] for rs in by_task.values() if rs]
    mean_acc = _mean([a for a in acc.values() if a is not None])
    niah = [t for t in tasks if t.startswith("niah_") and acc.get(t) is not None]
    b_total, b_parts = _bytes(task_recs)
    return {
        "accuracy": acc, "accuracy_ci": acc_ci, "ci_method": how, "samples": n, "diff_vs_dense": diff,
        "diff_ci_method": diff_how,
        "mean_accuracy": mean_acc, "mean_accuracy_ci": list(effective_size_wilson_interval(groups)),
        "needle_accuracy": _mean([acc[t] for t in niah]) if niah else None,
        "needle_accuracy_ci": list(effective_size_wilson_interval([[r["score"] for r in by_task[t]] for t in niah]))
        if niah else [None, None],
        "cost": _mean([r["sampled_fraction"] for r in task_recs]),
        "ms_per_step": _mean([r.get("ms_per_step") for r in task_recs]),
        "ms_per_step_ci": _ci([r.get("ms_per_step") for r in task_recs]),
        "bytes_per_step": b_total, "bytes_per_step_parts": b_parts,
        # the whole prompt (setup B: the document plus its decoded question part): the haystack grows by
        # whole sentences, so a prompt may fall short of the length less the answer's tokens
        "prompt_tokens_range": _range([r["prompt_tokens"] + (r.get("question_tokens") or 0) for r in task_recs
                                       if r.get("prompt_tokens") is not None]),
    }


def _range(xs: list[int]) -> list[int] | None:
    return [min(xs), max(xs)] if xs else None


def topk_reference(settings: EvalSettings) -> str | None:
    """The TopK method the ``KL − TopK`` and ``ms − TopK`` differences are taken against.

    ``topk`` (its budget measured from the MagicPIG reference method on each sample) when it was
    asked for, else the first TopK method, else None.
    """
    tops = [m.label for m in settings.methods if m.backend == "topk"]
    return "topk" if "topk" in tops else (tops[0] if tops else None)


def _paired(pairs: list[tuple[float, float]]) -> list[float | None]:
    if not pairs:
        return [None, None, None]
    mean = sum(a - b for a, b in pairs) / len(pairs)
    if not math.isfinite(mean):  # t_interval drops NaN and inf: the interval of a broken mean would look whole
        return [math.nan, math.nan, math.nan]
    return [mean, *paired_t_interval([a for a, _ in pairs], [b for _, b in pairs])]


def _sign(pairs: list[tuple[float, float]]) -> dict:
    """``{"higher", "of", "p"}``: :func:`~magicpig_jax.eval.stats.sign_test` of the pairs (all None
    when a pair holds NaN)."""
    if any(a is not None and b is not None and math.isnan(a - b) for a, b in pairs):
        return {"higher": None, "of": None, "p": None}
    higher, n, p = sign_test([a for a, _ in pairs], [b for _, b in pairs])
    return {"higher": higher, "of": n, "p": p}


def _broken(diff: list[float | None]) -> bool:
    return diff[0] is not None and math.isnan(diff[0])


def _verdict(diff: list[float | None], sign: dict) -> str:
    """Lower or higher KL when the paired t interval excludes 0; else by the sign test at 5%, which a
    single outlying document cannot swing (the mean's t interval can); else a tie. ``"NaN KL"``
    when a document's KL is NaN or infinite (no comparison)."""
    if _broken(diff):
        return "NaN KL"
    lo, hi = diff[1:]
    if lo is not None and hi is not None and not lo <= 0 <= hi:
        return "lower KL" if hi < 0 else "higher KL"
    if sign["p"] is not None and sign["p"] < 0.05:
        return ("higher KL" if 2 * sign["higher"] > sign["of"] else "lower KL") + " (sign test)"
    return "tie"


def equal_ms_comparison(records: Sequence[dict], settings: EvalSettings) -> dict:
    """Per length and TopK method: the LSH variant with the least KL among those no slower than it.

    The question of issue 15: at equal measured time per decode step, does the best MagicPIG
    variant reach TopK's KL? Both are measured on the same likelihood documents, back to back
    after the same prefill, so their ms and KL are compared *paired* over the documents: a
    variant is *no slower* than a TopK method when its mean paired ms difference is ``<= 0``.
    Candidates: the MagicPIG and hybrid methods (``magicpig:KxL``, ``magicpig@FILE``,
    ``hybrid:...``) whose attention ran on the host op (the pure-JAX ones are not at their best
    implementation, so their time does not count).

    Args:
      records: the result records.
      settings: the run's settings (methods, lengths, likelihood documents).

    Returns:
      ``{length: [row, ...]}``, a row per TopK method with ``topk``, ``topk_ms``, ``topk_kl`` (TopK's
      means over the chosen variant's paired documents; over all of TopK's when none is chosen),
      ``method`` (the chosen variant, or None when there is no candidate; among the no-slower ones,
      the least mean paired KL difference from TopK), ``no_slower``
      (False: no candidate is no slower, and ``method`` is the fastest one), ``ms_diff`` and
      ``kl_diff`` (``[mean, low, high]`` of variant − TopK, paired t intervals), ``kl_sign``
      (``{"higher", "of", "p"}``: documents where the variant's KL is the higher, documents that
      differ, the exact sign test's two-sided p), ``kl`` (the variant's mean over the paired
      documents), ``documents`` and ``verdict`` (``"lower KL"`` when the KL interval lies below
      0, ``"higher KL"`` above; else ``"... (sign test)"`` when the sign test gives p < 0.05;
      else ``"tie"``).
    """
    n_lik = settings.likelihood_documents
    by_label = {m.label: m for m in settings.methods}
    out: dict = {}
    for length in settings.lengths:
        lik: dict[str, dict[int, dict]] = {}
        for r in records:
            if r["kind"] == "likelihood" and r["length"] == length and r["index"] < n_lik and r["method"] in by_label:
                lik.setdefault(r["method"], {})[r["index"]] = r
        cands = [lab for lab, m in by_label.items() if m.backend in ("magicpig", "hybrid") and lab in lik
                 and all("host" in (r.get("attention_runs_on") or "") for r in lik[lab].values())]
        rows = []
        for top in (lab for lab, m in by_label.items() if m.backend == "topk" and lab in lik):
            t = lik[top]
            options = []
            for lab in cands:
                docs = sorted(set(t) & set(lik[lab]))
                if not docs:
                    continue
                ms = _paired([(a, b) for a, b in ((lik[lab][i].get("ms_per_step"), t[i].get("ms_per_step"))
                                                  for i in docs) if a is not None and b is not None])
                kl_pairs = [(lik[lab][i]["kl"], t[i]["kl"]) for i in docs]
                options.append({"method": lab, "ms_diff": ms, "kl_diff": _paired(kl_pairs), "kl_sign": _sign(kl_pairs),
                                "documents": len(docs), "kl": _mean([lik[lab][i]["kl"] for i in docs]), "docs": docs})
            row = {"topk": top, "topk_ms": _mean([r["ms_per_step"] for r in t.values()]),
                   "topk_kl": _mean([r["kl"] for r in t.values()]), "method": None, "no_slower": False,
                   "ms_diff": [None] * 3, "kl_diff": [None] * 3, "kl_sign": None, "kl": None, "documents": 0,
                   "verdict": None}
            options = [o for o in options if o["ms_diff"][0] is not None]  # no timed step: no time to compare
            # a variant with a NaN KL is chosen only when no other is there (its verdict says NaN)
            options = [o for o in options if not _broken(o["kl_diff"])] or options
            fast = [o for o in options if o["ms_diff"][0] <= 0]
            # by the mean paired difference from TopK: the variants' own means may cover different documents
            pick = (min(fast, key=lambda o: o["kl_diff"][0]) if fast
                    else min(options, key=lambda o: o["ms_diff"][0]) if options else None)
            if pick is not None:
                docs = pick.pop("docs")
                row.update(pick, no_slower=bool(fast), verdict=_verdict(pick["kl_diff"], pick["kl_sign"]),
                           topk_ms=_mean([t[i]["ms_per_step"] for i in docs]),
                           topk_kl=_mean([t[i]["kl"] for i in docs]))
            rows.append(row)
        out[length] = rows
    return out


def summarize(records: Sequence[dict], settings: EvalSettings) -> dict:
    """Aggregate records: ``{length: {method: {...}}}`` with means and 95% intervals.

    Only records of the requested tasks, lengths, methods, setups and sample indices count.
    Per method and length: ``tasks`` (per setup: ``accuracy``, ``accuracy_ci``, ``ci_method``,
    ``samples``, ``diff_vs_dense`` ``[mean, low, high]`` of the paired score difference (its
    interval's method in ``diff_ci_method``: ``"newcombe"`` or ``"newcombe-mean"``),
    ``mean_accuracy`` (+ ``_ci``), ``needle_accuracy`` (+ ``_ci``, the NIAH tasks), ``cost``,
    ``ms_per_step`` (+ ``_ci``), ``bytes_per_step`` (+ ``_parts``), ``prompt_tokens_range`` (the
    shortest and longest whole prompt, question included)); from the likelihood
    documents ``kl``, ``nll``, ``top1`` (each + ``_ci``: means over the documents), ``ppl`` (+ ``_ci``:
    ``exp`` of the mean NLL, the perplexity of all their tokens), ``kl_minus_topk`` and
    ``ms_minus_topk`` ``[mean, low, high]`` (paired over the documents, against
    :func:`topk_reference`), ``attention_runs_on``, ``likelihood_cost``,
    ``likelihood_forced_tokens`` (the records' teacher-forced counts), ``likelihood_ms_per_step``
    (+ ``_ci``), ``likelihood_bytes_per_step`` (+ ``_parts``); over everything ``cost``,
    ``budget``, ``decode_tokens_per_s``; and the setup-A task figures (the first setup's without
    A) at the top level (``accuracy``, ``mean_accuracy``, ...) as before setups existed.
    Costs are fractions (not percentages); a mean over no records is None.

    Args:
      records: the result records (:class:`magicpig_jax.eval.store.ResultStore` values).
      settings: what was asked for (:class:`magicpig_jax.eval.run.EvalSettings`).
    """
    labels = [m.label for m in settings.methods]
    topk = topk_reference(settings)
    n_lik = settings.likelihood_documents
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
        topk_ms = {r["index"]: r.get("ms_per_step") for r in lik_recs(topk)} if topk else {}
        for lab in labels:
            lik = lik_recs(lab)
            tasks = {setup: _task_entry(task_recs(lab, setup), task_recs("dense", setup), settings.tasks)
                     for setup in setups}
            ms_pairs = [(r.get("ms_per_step"), topk_ms[r["index"]]) for r in lik if r["index"] in topk_ms]
            kl_pairs = [] if lab == topk else [(r["kl"], topk_kl[r["index"]]) for r in lik if r["index"] in topk_kl]
            kl_topk = _paired(kl_pairs)
            ms_topk = _paired([] if lab == topk else [(a, b) for a, b in ms_pairs if a is not None and b is not None])
            everything = [r for s in setups for r in task_recs(lab, s)] + lik
            b_total, b_parts = _bytes(lik)
            top = "A" if "A" in setups else setups[0]
            first = tasks[top]
            per[lab] = {
                "tasks": tasks,
                # setup A's figures (the first setup's without A) at the top level
                "accuracy": first["accuracy"], "accuracy_ci": first["accuracy_ci"], "samples": first["samples"],
                "mean_accuracy": first["mean_accuracy"], "mean_accuracy_ci": first["mean_accuracy_ci"],
                "task_cost": {t: _mean([r["sampled_fraction"] for r in task_recs(lab, top) if r["task"] == t])
                              for t in settings.tasks},
                "cost": _mean([r["sampled_fraction"] for r in everything]),
                "likelihood_cost": _mean([r["sampled_fraction"] for r in lik]),
                # what the records were forced over (a later run may have asked for none)
                "likelihood_forced_tokens": sorted({r["forced_tokens"] for r in lik if "forced_tokens" in r}),
                "likelihood_ms_per_step": _mean([r.get("ms_per_step") for r in lik]),
                "likelihood_ms_per_step_ci": _ci([r.get("ms_per_step") for r in lik]),
                "likelihood_bytes_per_step": b_total, "likelihood_bytes_per_step_parts": b_parts,
                "kl": _mean([r["kl"] for r in lik]), "kl_ci": _ci([r["kl"] for r in lik]),
                "kl_minus_topk": kl_topk, "kl_minus_topk_sign": _sign(kl_pairs), "ms_minus_topk": ms_topk,
                "attention_runs_on": next((r.get("attention_runs_on") for r in lik if r.get("attention_runs_on")),
                                          None),
                # perplexity of the documents' tokens together, exp(mean NLL) (each document has the same
                # token count), and its interval the same transform of the NLL's (exp is monotone)
                "ppl": _exp(_mean([r["nll"] for r in lik])), "ppl_ci": [_exp(x) for x in _ci([r["nll"] for r in lik])],
                "nll": _mean([r["nll"] for r in lik]), "nll_ci": _ci([r["nll"] for r in lik]),
                "top1": _mean([r["top1"] for r in lik]), "top1_ci": _ci([r["top1"] for r in lik], (0.0, 1.0)),
                "likelihood_samples": len(lik),
                "budget": _mean([r.get("budget") for r in everything if isinstance(r.get("budget"), int)]),
                "likelihood_budget": _mean([r.get("budget") for r in lik if isinstance(r.get("budget"), int)]),
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


def format_summary(summary: dict, settings: EvalSettings, header: str = "", equal_ms: dict | None = None) -> str:
    """The markdown summary: per context length, a task table per setup, a likelihood table and the
    equal-ms comparison, then a legend. A method without records in a table has no row there.

    Args:
      summary: :func:`summarize`'s result.
      settings: the run's settings (task columns, setups, budget reference, likelihood tokens).
      header: markdown put before the tables.
      equal_ms: :func:`equal_ms_comparison`'s result (None: no such table).
    """
    from magicpig_jax.eval.settings import SETUPS

    lines = [header] if header else []
    setups = _setups(settings)
    if settings.tasks:
        lines.append("\nRULER setups of the task prompts: " + "; ".join(f"**{s}**: {SETUPS[s]}" for s in setups) + ".")
    any_lik = False
    for length, per in summary.items():
        lines.append(f"\n### Context {length} tokens\n")
        for setup in setups if settings.tasks else []:
            n_task = max((max(v["tasks"][setup]["samples"].values(), default=0) for v in per.values()), default=0)
            spans = [v["tasks"][setup].get("prompt_tokens_range") for v in per.values()]
            spans = [x for x in spans if x]
            span = (f"; prompts of {min(x[0] for x in spans)}–{max(x[1] for x in spans)} tokens before the answer"
                    if spans else "")
            lines.append(f"\n#### Tasks, setup {setup} ({n_task} samples per task{span})\n")
            cols = [_SHORT.get(t, t) + " %" for t in settings.tasks]
            head = ["method", *cols, "mean %", "Δ vs dense (pp)", "keys %", "ms/step", "MB/step"]
            lines.append("| " + " | ".join(head) + " |")
            lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
            for lab, v in per.items():
                t = v["tasks"][setup]
                if not any(t["samples"].values()):
                    continue
                diffs = [d for d in t["diff_vs_dense"].values() if d and d[0] is not None]
                dcell = "; ".join(_diff(d, ".0f", 100) for d in t["diff_vs_dense"].values()) if diffs else "-"
                row = [lab, *[_with_ci(t["accuracy"][x], t["accuracy_ci"][x], ".0f", 100) for x in settings.tasks],
                       _with_ci(t["mean_accuracy"], t["mean_accuracy_ci"], ".1f", 100),
                       "-" if lab == "dense" else dcell, _pct(t["cost"], 2),
                       _with_ci(t["ms_per_step"], t["ms_per_step_ci"], ".1f"), _mb(t["bytes_per_step"])]
                lines.append("| " + " | ".join(row) + " |")
        n_lik = max((v["likelihood_samples"] for v in per.values()), default=0)
        if n_lik:
            any_lik = True
            forced = sorted({n for v in per.values() for n in v.get("likelihood_forced_tokens", ())}) or [
                settings.likelihood_tokens]
            lines.append(f"\n#### Likelihood ({n_lik} documents, {' or '.join(map(str, forced))} teacher-forced "
                         "tokens each)\n")
            head = ["method", "keys %", "budget", "ms/step", "ms − TopK", "MB/step (K / V / index / pages)", "KL",
                    "KL − TopK", "PPL", "top-1 %"]
            lines.append("| " + " | ".join(head) + " |")
            lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
            for lab, v in per.items():
                if not v["likelihood_samples"]:
                    continue
                parts = v["likelihood_bytes_per_step_parts"]
                mb = (f"{_mb(v['likelihood_bytes_per_step'])} ("
                      + " / ".join(_mb(parts.get(p)) for p in BYTE_PARTS) + ")")
                row = [lab, _pct(v["likelihood_cost"], 2), _num(v["likelihood_budget"], ".0f"),
                       _with_ci(v["likelihood_ms_per_step"], v["likelihood_ms_per_step_ci"], ".1f"),
                       _diff(v["ms_minus_topk"], ".1f"), mb,
                       _with_ci(v["kl"], v["kl_ci"], ".4f"), _diff(v["kl_minus_topk"], ".4f"),
                       _with_ci(v["ppl"], v["ppl_ci"], ".2f"), _with_ci(v["top1"], v["top1_ci"], ".1f", 100)]
                lines.append("| " + " | ".join(row) + " |")
        rows = (equal_ms or {}).get(length) or []
        if rows:
            lines.append("\n#### At equal measured time (likelihood documents, paired)\n")
            head = ["TopK", "TopK ms/step", "TopK KL", "LSH variant", "ms − TopK", "its KL", "KL − TopK", "verdict"]
            lines.append("| " + " | ".join(head) + " |")
            lines.append("|" + "|".join(["---"] * 4 + ["---:"] * 3 + ["---"]) + "|")
            for r in rows:
                name = "-" if r["method"] is None else r["method"]
                if r["method"] is not None and not r["no_slower"]:
                    name += " (none as fast; the fastest shown)"
                sign = r.get("kl_sign") or {}
                verdict = r["verdict"] or "-"
                if sign.get("p") is not None:
                    verdict += f" ({sign['higher']}/{sign['of']} documents higher, sign test p = {sign['p']:.2g})"
                cells = [r["topk"], _num(r["topk_ms"], ".1f"), _num(r["topk_kl"], ".4f"), name,
                         _diff(r["ms_diff"], ".1f"), _num(r["kl"], ".4f"), _diff(r["kl_diff"], ".4f"), verdict]
                lines.append("| " + " | ".join(cells) + " |")
    # the likelihood columns' legend, only when a likelihood table was written
    kl_legend = (
        " KL: mean KL(dense || method) of the next-token distribution "
        "over the teacher-forced prose tokens (as many as its table's heading says), t interval over documents; "
        "ms − TopK and "
        "KL − TopK: paired differences over the documents to TopK at the measured budget (else the first TopK "
        "method); PPL: exp of the mean NLL of those tokens over the documents (its interval: exp of the NLL's); "
        "top-1: argmax agreement with dense. The t intervals of quantities that "
        "cannot be negative (ms, KL) are clipped at 0, and top-1's at 100%. At equal measured time: for each TopK "
        "method, the MagicPIG or hybrid variant run on the host op with the least mean paired KL difference from it "
        "among those whose mean paired ms difference is <= 0 (no slower on the same documents), TopK's ms and KL "
        "taken over the variant's documents; verdict: lower or higher KL when the paired "
        "interval excludes 0, else by the exact sign test over the documents when p < 0.05 (a single outlying "
        "document widens the t interval of skewed KL differences, not the sign test), else a tie. Budget in the "
        "likelihood table: the mean over its documents.")
    lines.append(
        "\nEvery cell is a mean with its 95% interval in brackets. Accuracy: RULER's string_match_all (percent "
        "of expected strings in the answer) over the samples; interval: Wilson's (at the mean score when "
        "scores are fractions); mean over tasks: Wilson's at the effective sample size (Kish) of the mean of the "
        "tasks' accuracies. Δ vs dense: the paired difference of scores to dense on the "
        "same samples (percentage points), per task; interval: Newcombe's paired score interval (1998, method 10) "
        "(at the mean scores and their covariance when scores are fractions). "
        "Keys %: mean fraction of the context's keys sampled (MagicPIG, hybrid), selected (TopK, Quest) or "
        "distinctly drawn (oracle) per decode step in the sparse layers, static set excluded (dense = 100%). "
        "ms/step: measured wall time of a decode step (after the first), t interval over samples; on a shared "
        "machine it drifts. MB/step: K, V, index and page-metadata bytes one step's attention reads at the "
        "method's best host implementation (magicpig_jax.eval.cost). Budget: mean keys per query head given "
        f"to TopK/Quest/oracle (the measured MagicPIG {settings.budget_from} count, rounded to "
        f"{settings.page_size}-token pages)." + (kl_legend if any_lik else ""))
    return "\n".join(lines)


def finish(store: ResultStore, settings: EvalSettings, out: Path, model_source: str, plot: bool = True) -> str:
    """Write ``summary.md``, ``summary.json`` and (if ``plot``) the plots into ``out``; return the markdown.

    The header names the machine of the last invocation in ``runs.jsonl``, the wall time of the
    invocations logged there (an invocation is logged when it ends: one that was stopped is not),
    and the span and count of the folder's records, which cover every invocation; the tables
    summarize only the records this run's settings select.
    """
    out = Path(out)
    records = list(store.records.values())
    summary = summarize(records, settings)
    equal_ms = equal_ms_comparison(records, settings)
    runs = read_runs(out)
    wall = sum(r["wall_seconds"] for r in runs)
    machine = runs[-1]["machine"] if runs else machine_info()
    stamps = sorted(r["time"] for r in records if r.get("time"))
    span = f" Records written from {stamps[0]} to {stamps[-1]}." if stamps else ""
    header = (f"## magicpig-jax eval: {model_source}\n\n"
              f"Machine: {machine.get('cpu', machine.get('platform'))}, {machine.get('cpus')} CPUs, "
              f"devices {machine.get('devices')}, jax {machine.get('jax')}. Wall time of the {len(runs)} "
              f"invocation(s) logged in this folder: {wall / 3600:.2f} h.{span} Records in the folder: {len(records)} "
              "(the tables use those of this run's tasks, lengths, samples and methods). "
              f"Haystack: {settings.haystack}; "
              + (f"static set {settings.num_sink} sink + {settings.num_local} local; "
                 if any(m.backend != "dense" for m in settings.methods) else "")
              + f"seed {settings.seed}.")
    text = format_summary(summary, settings, header, equal_ms)
    (out / "summary.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps({"setups": _setups(settings),
                                                  "equal_ms": {str(k): v for k, v in equal_ms.items()},
                                                  **{str(k): v for k, v in summary.items()}}, indent=2) + "\n")
    if plot:
        from magicpig_jax.eval.plots import write_plots

        write_plots(summary, settings, out)
    return text
