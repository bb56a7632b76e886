"""The figure of the attention study (``study.png``): error versus cost per estimator."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_study"]


def plot_study(summary: list[dict], path: Path) -> None:
    """Relative error versus fraction of keys touched, one log-log panel per source, as a PNG.

    Args:
      summary: rows of :func:`magicpig_jax.eval.study_measure.summarize`.
      path: the PNG to write.

    Raises:
      RuntimeError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise RuntimeError("the PNG needs matplotlib (pip install matplotlib), or pass --no-plot") from err
    sources = sorted({s["source"] for s in summary})
    fig, axes = plt.subplots(1, len(sources), figsize=(6.5 * len(sources), 5), squeeze=False)
    styles = {"topk": ("C0", "o-"), "quest": ("C1", "s-"), "oracle": ("C2", "^-")}
    for ax, source in zip(axes[0], sources, strict=True):
        rows = [s for s in summary if s["source"] == source]
        for method, (color, style) in styles.items():
            pts = sorted((s["fraction"], s["rel_error"]) for s in rows if s["method"] == method)
            if pts:
                ax.plot(*zip(*pts, strict=True), style, color=color, label=method, ms=4)
        for center, marker in ((True, "*"), (False, "x")):
            pts = [s for s in rows if s["method"] == "magicpig" and s["params"]["center"] == center]
            if pts:
                ax.scatter([s["fraction"] for s in pts], [s["rel_error"] for s in pts], marker=marker,
                           s=70, color="C3" if center else "C7",
                           label="MagicPIG " + ("centered" if center else "uncentered"))
                for s in pts:
                    ax.annotate(f"K{s['params']['K']}L{s['params']['L']}", (s["fraction"], s["rel_error"]),
                                fontsize=7, xytext=(3, 3), textcoords="offset points")
        hyb = [s for s in rows if s["method"] == "hybrid"]
        if hyb:
            ax.scatter([s["fraction"] for s in hyb], [s["rel_error"] for s in hyb], marker="P", s=50, color="C4",
                       label="hybrid (heavy exact)")
            for s in hyb:
                ax.annotate(f"m{s['params']['heavy']}", (s["fraction"], s["rel_error"]), fontsize=6,
                            xytext=(3, -8), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("fraction of keys attended (TopK's budget; it scores every key)")
        ax.set_ylabel("relative error ||o_hat - o|| / ||o|| (mean over heads, cases and seeds)")
        ax.set_title(f"attention estimators: {source}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
