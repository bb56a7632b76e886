"""Reporting of ``magicpig-jax eval``: the per-length summary, its markdown tables and the plots.

Accuracy is RULER's ``string_match_all``; cost is the fraction of the context's keys a method
sampled or selected per decode step in the sparse layers (arXiv 2410.16179, Section 5: cost
follows the number of keys touched); KL, perplexity and top-1 agreement come from the
teacher-forced likelihood samples (:mod:`magicpig_jax.eval.likelihood`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from magicpig_jax.eval.store import ResultStore, machine_info, read_runs

if TYPE_CHECKING:
    from magicpig_jax.eval.run import EvalSettings

__all__ = ["summarize", "format_summary", "write_plots", "finish"]


def _mean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def summarize(records: Sequence[dict], settings: EvalSettings) -> dict:
    """Aggregate records: ``{length: {method: {...}}}`` with per-task accuracy, cost, KL, PPL.

    Only records of the requested tasks, lengths, methods and sample indices count.
    Cost = mean ``sampled_fraction`` (a fraction of the context's keys, not a percentage)
    over the method's task and likelihood records; a mean over no records is None.

    Args:
      records: the result records (:class:`magicpig_jax.eval.store.ResultStore` values).
      settings: what was asked for (:class:`magicpig_jax.eval.run.EvalSettings`).
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
    """The markdown summary: one table per context length (accuracy and cost in percent), then a legend.

    Args:
      summary: :func:`summarize`'s result.
      settings: the run's settings (task columns, budget reference, likelihood tokens).
      header: markdown put before the tables.
    """
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
    """``accuracy_vs_cost.png`` (one panel per task, plus the mean) and ``kl_vs_cost.png`` (matplotlib, Agg).

    Args:
      summary: :func:`summarize`'s result.
      settings: the run's settings (methods give the colours, tasks the panels).
      out: the folder to write into.

    Returns:
      The paths written: the accuracy figure when there are tasks, the KL figure when
      there are likelihood records.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    labels = [m.label for m in settings.methods]
    colors = {lab: plt.get_cmap("tab10")(i % 10) for i, lab in enumerate(labels)}
    marker = {length: _MARKERS[i % len(_MARKERS)] for i, length in enumerate(summary)}
    written = []
    if settings.tasks:
        written.append(_accuracy_plot(plt, summary, settings, colors, marker, out / "accuracy_vs_cost.png"))
    if any(v["kl"] is not None for per in summary.values() for v in per.values()):
        written.append(_kl_plot(plt, summary, settings, colors, marker, out / "kl_vs_cost.png"))
    return written


def _accuracy_plot(plt, summary: dict, settings: EvalSettings, colors: dict, marker: dict, path: Path) -> Path:
    panels = [*settings.tasks, "mean"]
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _kl_plot(plt, summary: dict, settings: EvalSettings, colors: dict, marker: dict, path: Path) -> Path:
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _legend(fig, colors: dict, marker: dict) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, marker="o", linestyle="", label=lab) for lab, c in colors.items()]
    handles += [Line2D([], [], color="gray", marker=mk, linestyle="", label=f"{length} tokens")
                for length, mk in marker.items()]
    fig.legend(handles=handles, loc="center right", fontsize=8, frameon=False)


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
    (out / "summary.json").write_text(json.dumps({str(k): v for k, v in summary.items()}, indent=2) + "\n")
    if plot:
        write_plots(summary, settings, out)
    return text
