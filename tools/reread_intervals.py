"""Re-read committed eval folders with the summary's current task intervals.

  python tools/reread_intervals.py examples/results/eval15 examples/results/eval17n ...

The summaries committed before 2026-12-07 gave the paired accuracy difference to dense (Δ) a
Student's t interval and the mean over tasks a percentile bootstrap; both collapse to a point
where every sample scored alike (two methods agreeing on all 20 samples: Δ 0 [0, 0]). The
summary now uses Newcombe's paired score interval for 0/1 scores and a stratified Wilson
interval for the mean (:mod:`magicpig_jax.eval.stats`). For every invocation logged in each
folder's ``runs.jsonl`` (its tasks, lengths, samples and methods, from its ``argv``) and every
(length, setup, method, task), this prints Δ with the current interval beside the paired t
interval, and flags a cell where the two disagree on whether the interval holds 0 (the
"within dense's interval" verdict; a cell of one sample has no t interval and is not compared).
It reads only the records: no model is loaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from magicpig_jax.eval.report import summarize
from magicpig_jax.eval.settings import make_parser, settings_from_args
from magicpig_jax.eval.stats import paired_t_interval
from magicpig_jax.eval.store import ResultStore


def _pp(v) -> str:
    return "-" if v is None else f"{100 * v:+.1f}"


def _holds_zero(lo, hi) -> bool | None:
    return None if lo is None else lo <= 0.0 <= hi


def _last_wins(parser, args: list[str]) -> list[str]:
    """``args`` with each repeated value option kept at its last occurrence: the eval that logged them
    kept the last value of a repeated option, today's parser refuses a repeat (eval15's runs give
    --likelihood-samples twice). Options that gather their repeats (``action="append"``, such as
    --magicpig-config) keep every occurrence."""
    groups, i = [], 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        action = parser._option_string_actions.get(name) if name.startswith("--") else None
        takes = action is not None and action.nargs != 0 and "=" not in args[i]
        single = action is not None and not isinstance(action, (argparse._AppendAction, argparse._CountAction))
        groups.append((action.dest if single else None, args[i:i + 1 + takes]))
        i += 1 + takes
    last = {dest: k for k, (dest, _) in enumerate(groups) if dest is not None}
    return [tok for k, (dest, toks) in enumerate(groups) if dest is None or last[dest] == k for tok in toks]


def reread(folder: Path) -> tuple[int, int]:
    """Print the Δ cells of every logged invocation of ``folder``; return (cells, cells with a paired t
    interval, verdict flips)."""
    records = list(ResultStore(folder / "results.jsonl").records.values())
    runs = [json.loads(line) for line in (folder / "runs.jsonl").read_text().splitlines() if line.strip()]
    cells = compared = flips = 0
    seen = set()
    for run in runs:
        argv = run["argv"]
        parser = make_parser()
        settings = settings_from_args(parser.parse_args(_last_wins(parser, argv[argv.index("eval") + 1:])))
        summary = summarize(records, settings)
        for length, per in summary.items():
            for label, entry in per.items():
                if label == "dense":
                    continue
                for setup, t in entry["tasks"].items():
                    for task, (mean, lo, hi) in t["diff_vs_dense"].items():
                        key = (length, setup, label, task)
                        if mean is None or key in seen:
                            continue
                        seen.add(key)
                        mine = [r for r in records if r.get("kind") == "task" and r["length"] == length
                                and r["task"] == task and r.get("setup", "A") == setup
                                and r["index"] < settings.samples]
                        dense = {r["index"]: r["score"] for r in mine if r["method"] == "dense"}
                        pairs = [(r["score"], dense[r["index"]]) for r in mine
                                 if r["method"] == label and r["index"] in dense]
                        t_lo, t_hi = paired_t_interval([a for a, _ in pairs], [b for _, b in pairs])
                        # a single pair has no t interval: no verdict to compare
                        flip = t_lo is not None and _holds_zero(lo, hi) != _holds_zero(t_lo, t_hi)
                        cells += 1
                        compared += t_lo is not None
                        flips += flip
                        print(f"{folder.name} {length} {setup} {label} {task}: Δ {_pp(mean)} "
                              f"[{_pp(lo)}, {_pp(hi)}] ({t['diff_ci_method'][task]}); paired t "
                              f"[{_pp(t_lo)}, {_pp(t_hi)}]" + ("  <- verdict differs" if flip else ""))
    return cells, compared, flips


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", type=Path, nargs="+", help="eval output folders (results.jsonl and runs.jsonl)")
    args = p.parse_args(argv)
    total = total_compared = total_flips = 0
    for folder in args.folders:
        if not (folder / "runs.jsonl").exists() or not (folder / "results.jsonl").exists():
            print(f"{folder}: no runs.jsonl or results.jsonl, skipped")
            continue
        cells, compared, flips = reread(folder)
        total += cells
        total_compared += compared
        total_flips += flips
    print(f"{total} Δ cells, {total_compared} of them with a paired t interval (two samples or more); the verdict "
          f"(interval holds 0) differs from the paired t interval's in {total_flips}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
