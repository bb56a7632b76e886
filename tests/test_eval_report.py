"""magicpig_jax.eval.report: the summary's means over the requested records, its markdown, the plots."""

from __future__ import annotations

import pytest

from magicpig_jax.eval import run
from magicpig_jax.eval.methods import parse_methods
from magicpig_jax.eval.report import format_summary, summarize, write_plots
from magicpig_jax.eval.run import EvalSettings


def _rec(kind, method, index, **kw):
    task = "vt" if kind == "task" else "prose"
    return {"kind": kind, "task": task, "length": 1024, "index": index, "method": method,
            "sampled_fraction": 1.0 if method == "dense" else 0.05, "decode_tokens_per_s": 10.0, **kw}


def test_summarize_and_format():
    settings = EvalSettings(tasks=["vt"], lengths=[1024], samples=2, methods=parse_methods("dense,topk:16"),
                            likelihood_samples=1, likelihood_tokens=8)
    lik = {"kl": 0.0, "ppl": 3.0, "nll": 1.0986, "top1": 1.0}
    records = [
        _rec("task", "dense", 0, score=1.0), _rec("task", "dense", 1, score=0.5),
        _rec("task", "dense", 2, score=0.0),  # index >= samples: not counted
        _rec("task", "topk:16", 0, score=0.0, budget=16), _rec("task", "topk:16", 1, score=1.0, budget=16),
        _rec("likelihood", "dense", 0, **lik),
        _rec("likelihood", "topk:16", 0, budget=16, **{**lik, "kl": 0.25, "top1": 0.5}),
        _rec("likelihood", "topk:16", 1, **{**lik, "kl": 9.0}),  # index >= likelihood_samples
    ]
    s = summarize(records, settings)
    dense, topk = s[1024]["dense"], s[1024]["topk:16"]
    assert dense["accuracy"] == {"vt": 0.75} and dense["samples"] == {"vt": 2}
    assert dense["cost"] == 1.0 and dense["kl"] == 0.0 and dense["budget"] is None
    assert topk["mean_accuracy"] == 0.5 and topk["cost"] == pytest.approx(0.05)
    assert topk["kl"] == 0.25 and topk["top1"] == 0.5 and topk["likelihood_samples"] == 1 and topk["budget"] == 16
    text = format_summary(s, settings, "## header")
    assert text.startswith("## header") and "### Context 1024 tokens (2 samples per task, 1 likelihood samples)" in text
    assert "| dense | 75 | 75.0 | 100.00 | - | 0.0000 | 3.00 | 100.0 | 10.00 |" in text
    assert "| topk:16 | 50 | 50.0 | 5.00 | 16 | 0.2500 |" in text


def test_write_plots(tmp_path):
    settings = EvalSettings(tasks=[], lengths=[1024], samples=1, methods=parse_methods("dense,topk:16"))
    lik = {"kl": 0.1, "ppl": 3.0, "nll": 1.0, "top1": 1.0}
    s = summarize([_rec("likelihood", "dense", 0, **lik), _rec("likelihood", "topk:16", 0, **lik)], settings)
    assert write_plots(s, settings, tmp_path) == [tmp_path / "kl_vs_cost.png"]  # no tasks: no accuracy figure
    assert (tmp_path / "kl_vs_cost.png").read_bytes()[:4] == b"\x89PNG"


def test_run_re_exports_the_split_names():
    from magicpig_jax.eval import methods, report, store

    assert run.summarize is report.summarize and run.finish is report.finish
    assert run.ResultStore is store.ResultStore and run.parse_methods is methods.parse_methods
    assert all(hasattr(run, name) for name in run.__all__)
