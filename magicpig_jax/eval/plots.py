"""The plots of ``magicpig-jax eval``: accuracy and KL against the fraction of keys and against ms per step (Pareto)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from magicpig_jax.eval.settings import EvalSettings

from magicpig_jax.eval.report import _SHORT, _ci, _mean, _setups, _vals  # noqa: F401

__all__ = ["write_plots", "pareto_front"]


_MARKERS = "os^Dv<>P*X"


def _suptitle(fig, text: str, fontsize: float = 12) -> float:
    """The figure's title wrapped to its width (a long title was cut off at the edges); returns
    the top of the area left to the axes, for ``tight_layout(rect=...)``."""
    width = max(30, int(fig.get_figwidth() * 72 * 0.9 / (0.55 * fontsize)))
    lines = textwrap.wrap(text, width)
    fig.suptitle("\n".join(lines), fontsize=fontsize)
    return 1.0 - (len(lines) * 1.35 + 1.2) * fontsize / 72 / fig.get_figheight()


def _legend_room(panels_width: float, labels) -> tuple[float, float]:
    """The figure width (inches) for ``panels_width`` of axes plus a legend of ``labels`` at the right, and
    the fraction of it left to the axes (for ``tight_layout(rect=...)``): a fixed fraction let long method
    labels run over a single panel."""
    legend = 0.5 + max((len(str(x)) for x in labels), default=8) * 8 * 0.55 / 72  # 8-point text
    width = panels_width + legend
    return width, 1.0 - legend / width


def _plain_log_ticks(axis) -> None:
    """Log-scale ticks written as plain numbers (2, 5, 10, 100) instead of 2x10^0."""
    from matplotlib.ticker import FuncFormatter

    def minor(x, _):
        mantissa = x / 10 ** math.floor(math.log10(x)) if x > 0 else 0
        return f"{x:g}" if round(mantissa) in (2, 5) and abs(mantissa - round(mantissa)) < 1e-6 else ""

    axis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    axis.set_minor_formatter(FuncFormatter(minor))


def pareto_front(points: Sequence[tuple[float, float, str]],
                 maximize_y: bool = False) -> list[tuple[float, float, str]]:
    """The non-dominated points of ``(x, y, label)``: lower x is better; lower y (or higher, ``maximize_y``).

    Returns them sorted by x (ties: the better y first). A point is dominated when another is at
    least as good in both and better in one.
    """
    pts = [p for p in points if p[0] is not None and p[1] is not None]
    sign = -1.0 if maximize_y else 1.0
    pts.sort(key=lambda p: (p[0], sign * p[1]))
    front, best = [], math.inf
    for x, y, lab in pts:
        if sign * y < best:
            front.append((x, y, lab))
            best = sign * y
    return front


def _err(v, ci, scale=1.0):
    lo, hi = (ci or [None, None])[:2]
    if v is None or lo is None or hi is None:
        return None
    return [[max(scale * (v - lo), 0.0)], [max(scale * (hi - v), 0.0)]]


def write_plots(summary: dict, settings: EvalSettings, out: Path) -> list[Path]:
    """The figures of the run (matplotlib, Agg), with the 95% intervals as error bars.

    ``accuracy_vs_cost.png`` (one panel per task plus the mean; setup A filled, B hollow) and
    ``accuracy_vs_ms.png`` (needle accuracy against ms per step, a panel per length and setup,
    the Pareto front and dense's interval as a band) when there are tasks; ``kl_vs_cost.png``
    and ``kl_vs_ms.png`` (KL against ms per step, a panel per length, the Pareto fronts of the
    MagicPIG/hybrid variants and of the TopK budgets, dense's ms as a line; a method whose
    attention ran in pure JAX is left out, its time not being a cost) when there are likelihood
    records.

    Args:
      summary: :func:`summarize`'s result.
      settings: the run's settings (methods give the colours, tasks the panels).
      out: the folder to write into.

    Returns:
      The paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    labels = [m.label for m in settings.methods]
    cmap, n = (plt.get_cmap("tab10"), 10) if len(labels) <= 10 else (plt.get_cmap("tab20"), 20)
    colors = {lab: cmap(i % n) for i, lab in enumerate(labels)}
    marker = {length: _MARKERS[i % len(_MARKERS)] for i, length in enumerate(summary)}
    written = []
    if settings.tasks:
        written.append(_accuracy_plot(plt, summary, settings, colors, marker, out / "accuracy_vs_cost.png"))
        if any(t.startswith("niah_") for t in settings.tasks):
            written.append(_accuracy_ms_plot(plt, summary, settings, colors, out / "accuracy_vs_ms.png"))
    if any(v["kl"] is not None for per in summary.values() for v in per.values()):
        written.append(_kl_plot(plt, summary, settings, colors, marker, out / "kl_vs_cost.png"))
        written.append(_kl_ms_plot(plt, summary, settings, colors, out / "kl_vs_ms.png"))
    return written


def _accuracy_plot(plt, summary: dict, settings: EvalSettings, colors: dict, marker: dict, path: Path) -> Path:
    panels = [*settings.tasks, "mean"]
    ncol = min(4, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    width, right = _legend_room(4.2 * ncol, [*colors, "setup A"])
    fig, axes = plt.subplots(nrow, ncol, figsize=(width, 3.4 * nrow), squeeze=False)
    setups = _setups(settings)
    for ax, task in zip(axes.flat, panels, strict=False):
        for length, per in summary.items():
            for lab, v in per.items():
                for si, setup in enumerate(setups):
                    t = v["tasks"][setup]
                    acc = t["mean_accuracy"] if task == "mean" else t["accuracy"].get(task)
                    ci = t["mean_accuracy_ci"] if task == "mean" else t["accuracy_ci"].get(task)
                    cost = t["cost"]
                    if acc is None or cost is None:
                        continue
                    ax.errorbar([100 * cost], [100 * acc], yerr=_err(acc, ci, 100), color=colors[lab],
                                marker=marker[length], ms=6, mfc=colors[lab] if si == 0 else "none", alpha=0.85,
                                capsize=2, lw=0.8)
        ax.set_xscale("log")
        _plain_log_ticks(ax.xaxis)
        ax.set_title(task)
        ax.set_xlabel("keys used per step (%)")
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3, which="both")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    _legend(fig, colors, marker, setups)
    top = _suptitle(fig, "Task accuracy versus keys used (95% intervals; same prefill, same static set)")
    fig.tight_layout(rect=(0, 0, right, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _accuracy_ms_plot(plt, summary: dict, settings: EvalSettings, colors: dict, path: Path) -> Path:
    setups = _setups(settings)
    lengths = list(summary)
    width, right = _legend_room(4.4 * len(lengths), colors)
    fig, axes = plt.subplots(len(setups), len(lengths), figsize=(width, 3.6 * len(setups)), squeeze=False)
    for r, setup in enumerate(setups):
        for c, length in enumerate(lengths):
            ax = axes[r][c]
            pts = []
            for lab, v in summary[length].items():
                t = v["tasks"][setup]
                acc, ms = t["needle_accuracy"], t["ms_per_step"]
                if acc is None or ms is None:
                    continue
                if lab == "dense" and t["needle_accuracy_ci"][0] is not None:
                    lo, hi = t["needle_accuracy_ci"]
                    ax.axhspan(100 * lo, 100 * hi, color="gray", alpha=0.15, lw=0)
                ax.errorbar([ms], [100 * acc], xerr=_err(ms, t["ms_per_step_ci"]),
                            yerr=_err(acc, t["needle_accuracy_ci"], 100), color=colors[lab], marker="o", ms=6,
                            capsize=2, lw=0.8)
                pts.append((ms, 100 * acc, lab))
            front = pareto_front(pts, maximize_y=True)
            if len(front) > 1:
                ax.plot([p[0] for p in front], [p[1] for p in front], color="black", lw=0.8, ls="--", zorder=0)
            ax.set_title(f"{length} tokens, setup {setup}")
            ax.set_xlabel("ms per decode step (measured)")
            ax.set_ylabel("needle accuracy (%)")
            ax.set_ylim(-5, 105)
            ax.grid(alpha=0.3)
    _legend(fig, colors, {}, [])
    top = _suptitle(fig, "Needle accuracy versus measured time (95% intervals; dashed: Pareto front; band: "
                         "dense's interval)")
    fig.tight_layout(rect=(0, 0, right, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _kl_plot(plt, summary: dict, settings: EvalSettings, colors: dict, marker: dict, path: Path) -> Path:
    width, right = _legend_room(5.2, [*colors, "8192 tokens"])
    fig, ax = plt.subplots(figsize=(width, 4.5))
    for length, per in summary.items():
        for lab, v in per.items():
            if v["kl"] is None or v["likelihood_cost"] is None or lab == "dense":
                continue
            y = max(v["kl"], 1e-6)
            ax.errorbar([100 * v["likelihood_cost"]], [y], yerr=_err(v["kl"], v["kl_ci"]), color=colors[lab],
                        marker=marker[length], ms=6, capsize=2, lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_ticks(ax.xaxis)
    ax.set_xlabel("keys used per step (%)")
    ax.set_ylabel("mean KL(dense || method) (nats)")
    ax.grid(alpha=0.3, which="both")
    _legend(fig, {k: c for k, c in colors.items() if k != "dense"}, marker, [])
    top = _suptitle(fig, f"Next-token KL from dense over {settings.likelihood_tokens} teacher-forced tokens "
                         "(95% intervals)")
    fig.tight_layout(rect=(0, 0, right, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _kl_ms_plot(plt, summary: dict, settings: EvalSettings, colors: dict, path: Path) -> Path:
    lengths = list(summary)
    family = {m.label: "lsh" if m.backend in ("magicpig", "hybrid") else m.backend for m in settings.methods}
    width, right = _legend_room(4.6 * len(lengths), colors)
    fig, axes = plt.subplots(1, len(lengths), figsize=(width, 3.9), squeeze=False)
    for c, length in enumerate(lengths):
        ax = axes[0][c]
        pts = []
        for lab, v in summary[length].items():
            ms = v["likelihood_ms_per_step"]
            if ms is None or v["kl"] is None:
                continue
            if lab == "dense":
                ax.axvline(ms, color=colors[lab], lw=1, ls=":")
                continue
            if "host" not in (v.get("attention_runs_on") or "host"):
                continue  # pure JAX: its time is not the method's cost
            y = max(v["kl"], 1e-6)
            ax.errorbar([ms], [y], xerr=_err(ms, v["likelihood_ms_per_step_ci"]), yerr=_err(v["kl"], v["kl_ci"]),
                        color=colors[lab], marker="o", ms=6, capsize=2, lw=0.8)
            pts.append((ms, y, lab))
        # A front per family: where the LSH variants' line runs below TopK's at the same ms, they win.
        for fam, ls in (("lsh", "-"), ("topk", "--")):
            front = pareto_front([p for p in pts if family.get(p[2]) == fam])
            if len(front) > 1:
                ax.plot([p[0] for p in front], [p[1] for p in front], color="black", lw=0.8, ls=ls, zorder=0)
        ax.set_yscale("log")
        ax.set_title(f"{length} tokens")
        ax.set_xlabel("ms per decode step (measured)")
        ax.set_ylabel("mean KL(dense || method) (nats)")
        ax.grid(alpha=0.3, which="both")
    _legend(fig, colors, {}, [])
    top = _suptitle(fig, "KL from dense versus measured time (95% intervals; Pareto fronts: solid MagicPIG and "
                         "hybrid, dashed TopK; dotted: dense; methods run in pure JAX left out: no host time)", 9)
    fig.tight_layout(rect=(0, 0, right, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _legend(fig, colors: dict, marker: dict, setups: list[str]) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, marker="o", linestyle="", label=lab) for lab, c in colors.items()]
    handles += [Line2D([], [], color="gray", marker=mk, linestyle="", label=f"{length} tokens")
                for length, mk in marker.items()]
    if len(setups) > 1:
        handles += [Line2D([], [], color="gray", marker="o", linestyle="", mfc="gray" if i == 0 else "none",
                           label=f"setup {s}") for i, s in enumerate(setups)]
    fig.legend(handles=handles, loc="center right", fontsize=8, frameon=False)
