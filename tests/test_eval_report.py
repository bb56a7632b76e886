"""magicpig_jax.eval.report: the summary's means and 95% intervals over the requested records (against
SciPy), the setups, the markdown, the Pareto front and the plots."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from scipy import stats as sst

from magicpig_jax.eval import run
from magicpig_jax.eval.methods import parse_methods
from magicpig_jax.eval.plots import pareto_front, write_plots
from magicpig_jax.eval.report import format_summary, summarize
from magicpig_jax.eval.run import EvalSettings
from magicpig_jax.eval.stats import newcombe_paired_interval, paired_t_interval, wilson_interval


def _rec(kind, method, index, setup="A", **kw):
    task = "niah_single" if kind == "task" else "prose"
    rec = {"kind": kind, "task": task, "length": 1024, "index": index, "method": method,
           "sampled_fraction": 1.0 if method == "dense" else 0.05, "decode_tokens_per_s": 10.0,
           "ms_per_step": 20.0 + index, "bytes_per_step": {"k": 1e6, "v": 1e6, "index": 0.0, "pages": 0.0,
                                                             "total": 2e6}, **kw}
    if kind == "task":
        rec["setup"] = setup
    return rec


def test_summarize_and_format():
    settings = EvalSettings(tasks=["niah_single"], lengths=[1024], samples=4, methods=parse_methods("dense,topk:16"),
                            likelihood_samples=3, likelihood_tokens=8, setups=["A", "B"])
    lik = {"ppl": 3.0, "nll": 1.0986, "top1": 1.0}
    records = [
        *[_rec("task", "dense", i, score=s) for i, s in enumerate([1.0, 1.0, 1.0, 0.0])],
        _rec("task", "dense", 4, score=0.0),  # index >= samples: not counted
        *[_rec("task", "topk:16", i, score=s, budget=16) for i, s in enumerate([0.0, 1.0, 1.0, 0.0])],
        *[_rec("task", "dense", i, setup="B", score=1.0) for i in range(2)],
        *[_rec("likelihood", "dense", i, kl=0.0, **lik) for i in range(3)],
        *[_rec("likelihood", "topk:16", i, budget=16, kl=kl, **{**lik, "top1": 0.5})
          for i, kl in enumerate([0.25, 0.5, 0.75])],
        _rec("likelihood", "topk:16", 3, kl=9.0, **lik),  # index >= likelihood_samples
    ]
    s = summarize(records, settings)
    dense, topk = s[1024]["dense"], s[1024]["topk:16"]
    a = dense["tasks"]["A"]
    assert a["accuracy"] == {"niah_single": 0.75} and a["samples"] == {"niah_single": 4}
    assert a["accuracy_ci"]["niah_single"] == list(wilson_interval(3, 4)) and a["ci_method"]["niah_single"] == "wilson"
    assert dense["accuracy"] == a["accuracy"]  # setup A at the top level
    b = dense["tasks"]["B"]
    assert b["accuracy"] == {"niah_single": 1.0} and b["samples"]["niah_single"] == 2
    assert dense["kl"] == 0.0 and dense["budget"] is None and dense["likelihood_budget"] is None
    ta = topk["tasks"]["A"]
    assert ta["mean_accuracy"] == 0.5 and ta["cost"] == pytest.approx(0.05) and topk["budget"] == 16
    # paired difference to dense of 0/1 scores: -1, 0, 0, 0 -> mean -0.25 with Newcombe's paired interval
    assert ta["diff_vs_dense"]["niah_single"] == pytest.approx(
        [-0.25, *newcombe_paired_interval([0, 1, 1, 0], [1, 1, 1, 0])])
    assert ta["diff_ci_method"]["niah_single"] == "newcombe"
    # the mean over tasks: Wilson at the effective size (one task: its own Wilson); setup B's dense scored
    # 2 of 2, and its interval keeps a width (a bootstrap over the samples had none)
    assert ta["mean_accuracy_ci"] == pytest.approx(list(wilson_interval(2, 4)))
    assert b["mean_accuracy_ci"] == pytest.approx(list(wilson_interval(2, 2))) and b["mean_accuracy_ci"][0] < 0.5
    assert topk["kl"] == pytest.approx(0.5) and topk["likelihood_samples"] == 3
    lo, hi = sst.t.interval(0.95, 2, loc=0.5, scale=0.25 / math.sqrt(3))
    assert lo < 0 and topk["kl_ci"] == pytest.approx([0.0, hi])  # a KL is not negative: clipped at 0
    assert topk["likelihood_ms_per_step"] == pytest.approx(21.0) and topk["likelihood_bytes_per_step"] == 2e6
    ci = sst.t.interval(0.95, 2, loc=-0.5, scale=0.25 / math.sqrt(3))
    assert dense["kl_minus_topk"] == pytest.approx([-0.5, *ci])
    assert dense["ppl"] == pytest.approx(math.exp(1.0986))
    text = format_summary(s, settings, "## header")
    assert text.startswith("## header") and "### Context 1024 tokens" in text
    assert "**A**: the question is inside the dense prefill" in text and "**B**: the question is decoded" in text
    assert "#### Tasks, setup A (4 samples per task)" in text and "#### Tasks, setup B" in text
    assert "| dense | 75 [30, 95] |" in text  # Wilson (3/4): [0.301, 0.954]
    assert "#### Likelihood (3 documents, 8 teacher-forced tokens each)" in text
    assert "| topk:16 | 5.00 | 16 | 21.0 [18.5, 23.5] | - | 2.00 (1.00 / 1.00 / 0.00 / 0.00) | 0.5000 [" in text
    assert "KL: mean KL(dense || method) of the next-token distribution over the teacher-forced prose tokens" in text
    # without likelihood records the legend does not describe the likelihood columns
    tasks_only = format_summary(summarize([r for r in records if r["kind"] != "likelihood"], settings), settings)
    assert "#### Likelihood" not in tasks_only and "KL:" not in tasks_only and "Δ vs dense" in tasks_only


def test_pareto_front():
    pts = [(1.0, 0.5, "a"), (2.0, 0.2, "b"), (3.0, 0.3, "c"), (0.5, 0.9, "d"), (2.0, 0.1, "e")]
    assert [p[2] for p in pareto_front(pts)] == ["d", "a", "e"]
    assert [p[2] for p in pareto_front(pts, maximize_y=True)] == ["d"]
    assert pareto_front([(None, 1.0, "x")]) == []


def test_write_plots(tmp_path):
    settings = EvalSettings(tasks=["niah_single"], lengths=[1024], samples=2, methods=parse_methods("dense,topk:16"),
                            likelihood_samples=2, setups=["A", "B"])
    lik = {"kl": 0.1, "ppl": 3.0, "nll": 1.0, "top1": 1.0}
    recs = [_rec(kind, m, i, setup=st, score=1.0, **lik) for kind in ("task", "likelihood")
            for m in ("dense", "topk:16") for i in range(2) for st in ("A", "B")]
    s = summarize(recs, settings)
    names = {p.name for p in write_plots(s, settings, tmp_path)}
    assert names == {"accuracy_vs_cost.png", "accuracy_vs_ms.png", "kl_vs_cost.png", "kl_vs_ms.png"}
    for n in names:
        assert (tmp_path / n).read_bytes()[:4] == b"\x89PNG"
    lik_only = EvalSettings(tasks=[], lengths=[1024], samples=1, methods=parse_methods("dense,topk:16"))
    s = summarize([_rec("likelihood", "dense", 0, **lik), _rec("likelihood", "topk:16", 0, **lik)], lik_only)
    assert {p.name for p in write_plots(s, lik_only, tmp_path)} == {"kl_vs_cost.png", "kl_vs_ms.png"}


def test_run_re_exports_the_split_names():
    from magicpig_jax.eval import methods, report, store

    assert run.summarize is report.summarize and run.finish is report.finish
    assert run.ResultStore is store.ResultStore and run.parse_methods is methods.parse_methods
    assert all(hasattr(run, name) for name in run.__all__)


def test_equal_ms_comparison_pairs_documents_and_ignores_pure_jax_times():
    from magicpig_jax.eval.report import equal_ms_comparison, topk_reference

    methods = parse_methods("dense,magicpig:10x150,magicpig:9x150,hybrid:10x150x8,topk:64,topk,topk:288")
    settings = EvalSettings(tasks=["niah_single"], lengths=[1024], samples=1, methods=methods,
                            likelihood_samples=3, likelihood_tokens=8)
    assert topk_reference(settings) == "topk"  # the measured budget, though topk:64 comes first
    table = {  # method: (ms per document, KL per document, where its attention ran)
        "dense": ([40, 40, 40], [0, 0, 0], "dense (host exact op)"),
        "magicpig:10x150": ([25, 28, 28], [0.04, 0.05, 0.06], "magicpig (host op)"),
        "magicpig:9x150": ([29, 30, 34], [0.006, 0.009, 0.011], "magicpig (host op)"),
        "hybrid:10x150x8": ([1, 1, 1], [0.0, 0.0, 0.0], "hybrid (pure JAX)"),  # fast and exact: must not count
        "topk:64": ([20, 20, 20], [0.02, 0.02, 0.03], "topk (host op)"),
        "topk": ([30, 32, 34], [0.010, 0.012, 0.014], "topk (host op)"),
        "topk:288": ([31, 33, 35], [0.001, 0.002, 0.003], "topk (host op)"),
    }
    lik = {"ppl": 3.0, "nll": 1.0, "top1": 1.0}
    records = [_rec("likelihood", m, i, **{**lik, "ms_per_step": ms[i], "kl": kl[i], "attention_runs_on": on})
               for m, (ms, kl, on) in table.items() for i in range(3)]
    records.append(_rec("likelihood", "magicpig:9x150", 3, **{**lik, "ms_per_step": 1.0, "kl": 0.0,
                                                              "attention_runs_on": "magicpig (host op)"}))
    records.append(_rec("task", "dense", 0, score=1.0))
    rows = {r["topk"]: r for r in equal_ms_comparison(records, settings)[1024]}

    def paired(a, b):
        d = [x - y for x, y in zip(a, b, strict=True)]
        m = sum(d) / len(d)
        if len(set(d)) == 1:
            return [m, m, m]
        return [m, *sst.t.interval(0.95, len(d) - 1, loc=m, scale=sst.tstd(d) / math.sqrt(len(d)))]

    ms, kl = (lambda m: table[m][0]), (lambda m: table[m][1])
    # TopK at the measured budget: both MagicPIG variants are no slower; the lower KL one is chosen
    r = rows["topk"]
    assert r["method"] == "magicpig:9x150" and r["no_slower"] and r["documents"] == 3
    assert r["ms_diff"] == pytest.approx(paired(ms("magicpig:9x150"), ms("topk")))
    assert r["kl_diff"] == pytest.approx(paired(kl("magicpig:9x150"), kl("topk")))
    assert r["kl"] == pytest.approx(sum(kl("magicpig:9x150")) / 3) and r["verdict"] == "lower KL"
    assert r["topk_ms"] == pytest.approx(32.0) and r["topk_kl"] == pytest.approx(0.012)
    r = rows["topk:288"]
    assert r["method"] == "magicpig:9x150" and r["verdict"] == "higher KL"
    # nothing is as fast as topk:64: the fastest variant is named, flagged as slower
    r = rows["topk:64"]
    assert r["method"] == "magicpig:10x150" and not r["no_slower"] and r["ms_diff"][0] == pytest.approx(7.0)
    s = summarize(records, settings)[1024]
    assert s["magicpig:9x150"]["ms_minus_topk"] == pytest.approx(paired(ms("magicpig:9x150"), ms("topk")))
    assert s["topk"]["ms_minus_topk"] == [None, None, None]
    assert s["topk:64"]["kl_minus_topk"] == pytest.approx(paired(kl("topk:64"), kl("topk")))
    text = format_summary({1024: s}, settings, equal_ms={1024: list(rows.values())})
    assert "| ms − TopK |" in text and "#### At equal measured time" in text
    assert "| topk:64 | 20.0 | 0.0233 | magicpig:10x150 (none as fast; the fastest shown) | +7.0 [" in text
    task_table = text.split("#### Tasks, setup A")[1].split("####")[0]
    assert "| dense |" in task_table and "| topk" not in task_table  # no task records: no row


@pytest.mark.parametrize("width,fontsize", [(7.0, 12), (4.6, 9), (13.2, 12)])
def test_long_figure_titles_fit_the_figure(width, fontsize):
    """A title longer than the figure is wrapped, never cut off at the edges (kl_vs_ms.png was)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from magicpig_jax.eval.plots import _suptitle

    fig = plt.figure(figsize=(width, 3.9))
    text = ("KL from dense versus measured time (95% intervals; Pareto fronts: solid MagicPIG and hybrid, dashed "
            "TopK; dotted: dense; methods run in pure JAX left out: no host time)")
    top = _suptitle(fig, text, fontsize)
    fig.canvas.draw()
    box = fig._suptitle.get_window_extent(fig.canvas.get_renderer())
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height
    assert 0.5 < top < 1 and box.y0 >= top * fig.bbox.height - 1  # the axes area stays below it
    assert fig._suptitle.get_text().replace("\n", " ") == text
    plt.close(fig)


def test_the_likelihood_table_gives_its_own_documents_budget_and_nan_stays_visible():
    """The likelihood table's budget was the mean over the needle records too; a NaN KL was dropped
    from the mean (which then looked whole) while the documents were still counted."""
    settings = EvalSettings(tasks=["niah_single"], lengths=[1024], samples=2, methods=parse_methods("dense,topk"),
                            likelihood_samples=2, likelihood_tokens=8)
    lik = {"ppl": 3.0, "nll": 1.0, "top1": 1.0}
    records = [_rec("task", "dense", i, score=1.0) for i in range(2)] + [
        _rec("task", "topk", i, score=1.0, budget=100) for i in range(2)] + [
        _rec("likelihood", "dense", i, kl=0.0, **lik) for i in range(2)] + [
        _rec("likelihood", "topk", 0, budget=40, kl=0.01, **lik),
        _rec("likelihood", "topk", 1, budget=60, kl=math.nan, **lik)]
    topk = summarize(records, settings)[1024]["topk"]
    assert topk["budget"] == 75 and topk["likelihood_budget"] == 50
    assert math.isnan(topk["kl"]) and all(math.isnan(x) for x in topk["kl_ci"])
    text = format_summary(summarize(records, settings), settings)
    lik_table = text.split("#### Likelihood")[1]
    assert "| topk | 5.00 | 50 |" in lik_table


def test_equal_ms_verdict_uses_the_sign_test_when_an_outlier_widens_the_interval():
    from magicpig_jax.eval.report import equal_ms_comparison

    settings = EvalSettings(tasks=[], lengths=[1024], samples=1, methods=parse_methods("dense,magicpig,topk"),
                            likelihood_samples=16, likelihood_tokens=8)
    top = [0.01] * 16
    mp = [0.011] * 13 + [0.0095] * 2 + [0.0]  # higher on 13 documents, one outlier far lower
    lik = {"ppl": 3.0, "nll": 1.0, "top1": 1.0}
    records = [_rec("likelihood", m, i, **{**lik, "ms_per_step": ms, "kl": kl[i],
                                          "attention_runs_on": f"{m} (host op)"})
               for m, ms, kl in (("dense", 40.0, [0.0] * 16), ("magicpig:10x150", 20.0, mp), ("topk", 30.0, top))
               for i in range(16)]
    (row,) = equal_ms_comparison(records, settings)[1024]
    assert row["method"] == "magicpig:10x150" and row["kl_diff"][1] < 0 < row["kl_diff"][2]
    assert row["kl_sign"] == {"higher": 13, "of": 16, "p": pytest.approx(sst.binomtest(13, 16).pvalue)}
    assert row["verdict"] == "higher KL (sign test)"
    text = format_summary(summarize(records, settings), settings, equal_ms={1024: [row]})
    assert "higher KL (sign test) (13/16 documents higher, sign test p = 0.021)" in text
    # 12 of 16 (p = 0.077): a tie, as the t interval says
    mp[12] = 0.0095
    records = [r if r["method"] != "magicpig:10x150" else {**r, "kl": mp[r["index"]]} for r in records]
    (row,) = equal_ms_comparison(records, settings)[1024]
    assert row["kl_sign"]["higher"] == 12 and row["verdict"] == "tie"


def test_a_nan_kl_gives_no_verdict_and_is_not_chosen_over_a_finite_variant():
    """A NaN KL made the verdict 'higher KL' (the NaN interval read as excluding 0), and a variant with
    one NaN document could be chosen over a finite one."""
    from magicpig_jax.eval.report import equal_ms_comparison

    settings = EvalSettings(tasks=[], lengths=[1024], samples=1,
                            methods=parse_methods("dense,magicpig:10x150,magicpig:9x150,topk"),
                            likelihood_samples=16, likelihood_tokens=8)
    lik = {"ppl": 3.0, "nll": 1.0, "top1": 1.0}
    kls = {"dense": [0.0] * 16, "magicpig:10x150": [0.001] * 15 + [math.nan], "magicpig:9x150": [0.02] * 16,
           "topk": [0.01] * 16}
    ms = {"dense": 40.0, "magicpig:10x150": 20.0, "magicpig:9x150": 25.0, "topk": 30.0}

    def records(kls):
        return [_rec("likelihood", m, i, **{**lik, "ms_per_step": ms[m], "kl": kls[m][i],
                                              "attention_runs_on": f"{m} (host op)"}) for m in kls for i in range(16)]

    (row,) = equal_ms_comparison(records(kls), settings)[1024]
    assert row["method"] == "magicpig:9x150" and row["verdict"] == "higher KL"
    alone = {m: v for m, v in kls.items() if m != "magicpig:9x150"}
    settings = dataclasses.replace(settings, methods=parse_methods("dense,magicpig:10x150,topk"))
    (row,) = equal_ms_comparison(records(alone), settings)[1024]
    assert row["method"] == "magicpig:10x150" and row["verdict"] == "NaN KL"
    assert row["kl_sign"] == {"higher": None, "of": None, "p": None}


def test_perplexity_is_exp_of_the_mean_nll():
    """PPL over documents is the perplexity of all their tokens, exp(mean NLL) (each document has the
    same token count), not the mean of the documents' perplexities; its interval is exp of the NLL's."""
    settings = EvalSettings(tasks=[], lengths=[1024], samples=1, methods=parse_methods("dense"), likelihood_samples=3,
                            likelihood_tokens=8)
    nll = [1.0, 2.0, 4.0]
    records = [_rec("likelihood", "dense", i, kl=0.0, nll=x, ppl=math.exp(x), top1=1.0) for i, x in enumerate(nll)]
    dense = summarize(records, settings)[1024]["dense"]
    assert dense["ppl"] == pytest.approx(math.exp(7 / 3)) and dense["ppl"] < sum(map(math.exp, nll)) / 3
    lo, hi = sst.t.interval(0.95, 2, loc=7 / 3, scale=sst.tstd(nll) / math.sqrt(3))
    assert lo < 0 and dense["ppl_ci"] == pytest.approx([1.0, math.exp(hi)])  # an NLL is not negative: clipped at 0


def test_fractional_scores_get_wilson_at_their_means_and_newcombe_pairs():
    """A task scored in fractions (multi-value: 4 expected strings) has Wilson's interval at its mean
    and pairs with dense by Newcombe's interval at the means (the t intervals have zero width when every
    sample scores alike); the mean over tasks is Wilson's at the effective size."""
    settings = EvalSettings(tasks=["niah_single", "niah_multivalue"], lengths=[1024], samples=4,
                            methods=parse_methods("dense,topk:16"))
    frac = [0.75, 0.5, 1.0, 0.25]
    records = [
        *[_rec("task", "dense", i, score=1.0) for i in range(4)],
        *[{**_rec("task", "dense", i, score=1.0), "task": "niah_multivalue"} for i in range(4)],
        *[_rec("task", "topk:16", i, score=1.0, budget=16) for i in range(4)],
        *[{**_rec("task", "topk:16", i, score=s, budget=16), "task": "niah_multivalue"} for i, s in enumerate(frac)],
    ]
    ta = summarize(records, settings)[1024]["topk:16"]["tasks"]["A"]
    assert ta["ci_method"] == {"niah_single": "wilson", "niah_multivalue": "wilson-mean"}
    assert ta["diff_ci_method"] == {"niah_single": "newcombe", "niah_multivalue": "newcombe-mean"}
    z = 1.959963984540054
    m = 0.625  # Wilson at p = 0.625, n = 4
    center, half = (m + z * z / 8) / (1 + z * z / 4), z * math.sqrt(m * (1 - m) / 4 + z * z / 64) / (1 + z * z / 4)
    assert ta["accuracy_ci"]["niah_multivalue"] == pytest.approx([center - half, center + half])
    # dense scores 1 everywhere: phi is 0, so the interval is -0.375 - sqrt((m - l1)^2 + 0), ... (+ dense's
    # Wilson distance from 1 at 4 of 4)
    w1 = 1.0 - (1 + z * z / 8 - z * math.sqrt(z * z / 64)) / (1 + z * z / 4)  # 4 of 4's Wilson lower limit
    lo = (m - 1) - math.sqrt((m - (center - half)) ** 2 + 0.0)
    hi = (m - 1) + math.sqrt(w1 ** 2 + ((center + half) - m) ** 2)
    assert ta["diff_vs_dense"]["niah_multivalue"] == pytest.approx([m - 1, lo, min(hi, 1.0)])
    # both tasks' means (1.0 and 0.625) at the effective size 8: Wilson of 6.5 in 8, in [0, 1]
    mean = (1.0 + 0.625) / 2
    assert ta["mean_accuracy"] == pytest.approx(mean) and ta["needle_accuracy"] == pytest.approx(mean)
    z = 1.959963984540054
    center = (mean + z * z / 16) / (1 + z * z / 8)
    half = z * math.sqrt(mean * (1 - mean) / 8 + z * z / 256) / (1 + z * z / 8)
    assert ta["mean_accuracy_ci"] == pytest.approx([center - half, center + half])
    assert ta["needle_accuracy_ci"] == ta["mean_accuracy_ci"]


def test_reread_intervals_tool_flags_a_verdict_the_t_interval_gave_otherwise(tmp_path, capsys):
    """tools/reread_intervals.py on a folder: 20 pairs, the method losing the needle on 4 where dense
    found it, 16 agreeing: the paired t interval excludes 0, Newcombe's holds it (a changed verdict)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "reread_intervals", Path(__file__).parents[1] / "tools" / "reread_intervals.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    scores = {"dense": [1.0] * 4 + [0.0] * 16, "topk:16": [0.0] * 20}
    lines = [json.dumps({**_rec("task", m, i, score=s), **({"budget": 16} if m != "dense" else {})})
             for m, ss in scores.items() for i, s in enumerate(ss)]
    (tmp_path / "results.jsonl").write_text("\n".join(lines) + "\n")
    argv = ["magicpig-jax", "eval", "--samples", "20", "--tasks", "niah_single", "--lengths", "1024",
            "--methods", "dense,topk:16", "--likelihood-samples", "0", "--out", str(tmp_path)]
    (tmp_path / "runs.jsonl").write_text(json.dumps({"argv": argv}) + "\n")
    assert tool.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    t_lo, t_hi = paired_t_interval(scores["topk:16"], scores["dense"])
    n_lo, n_hi = newcombe_paired_interval(scores["topk:16"], scores["dense"])
    assert t_hi < 0 <= n_hi  # the case the tool exists to find
    assert f"Δ -20.0 [{100 * n_lo:+.1f}, {100 * n_hi:+.1f}] (newcombe); paired t [{100 * t_lo:+.1f}, " in out
    assert "<- verdict differs" in out
    # a logged argv with an option given twice (eval15's): the run kept the last value, today's parser refuses it
    from magicpig_jax.eval.settings import make_parser

    twice = ["--likelihood-samples", "16", "--no-progress", "--likelihood-samples=0", "--samples", "20"]
    assert tool._last_wins(make_parser(), twice) == ["--no-progress", "--likelihood-samples=0", "--samples", "20"]
    # a repeatable option (action="append") keeps every occurrence: two calibrated configs are two methods
    configs = ["--magicpig-config", "a.json", "--samples", "3", "--magicpig-config=b.json", "--samples", "20"]
    assert tool._last_wins(make_parser(), configs) == ["--magicpig-config", "a.json", "--magicpig-config=b.json",
                                                       "--samples", "20"]
    assert out.rstrip().endswith("1 Δ cells, 1 of them with a paired t interval (two samples or more); the verdict "
                                 "(interval holds 0) differs from the paired t interval's in 1")


def test_a_fractional_difference_keeps_a_width_and_needles_exclude_other_tasks():
    """Fractional scores that differ alike on every pair (0.25 against 0.5 on 20 samples, a model that
    repeats one of four needles): the paired t interval is a point, Newcombe's at the means is not and
    holds the difference; the needle accuracy and its interval read the NIAH tasks only (a
    variable-tracking task beside them is left out)."""
    from magicpig_jax.eval.report import _paired_scores

    (mean, lo, hi), how = _paired_scores([(0.25, 0.5)] * 20)
    assert paired_t_interval([0.25] * 20, [0.5] * 20) == pytest.approx((-0.25, -0.25))
    assert how == "newcombe-mean" and mean == pytest.approx(-0.25) and lo < -0.35 and -0.15 < hi < 0.05
    (mean, lo, hi), _ = _paired_scores([(0.0, 1.0), (0.75, 1.0)])
    assert mean == pytest.approx(-0.625) and -1.0 <= lo < mean < hi <= 1.0
    settings = EvalSettings(tasks=["niah_single", "vt"], lengths=[1024], samples=4,
                            methods=parse_methods("dense"))
    records = [*[_rec("task", "dense", i, score=1.0) for i in range(4)],
               *[{**_rec("task", "dense", i, score=0.0), "task": "vt"} for i in range(4)]]
    ta = summarize(records, settings)[1024]["dense"]["tasks"]["A"]
    assert ta["needle_accuracy"] == 1.0 and ta["needle_accuracy_ci"] == pytest.approx(list(wilson_interval(4, 4)))
    assert ta["mean_accuracy"] == 0.5 and ta["mean_accuracy_ci"] == pytest.approx(list(wilson_interval(4, 8)))


def test_the_likelihood_heading_counts_the_records_forced_tokens_and_setup_a_leads():
    """A later run into the folder with --likelihood-tokens 0 labelled the stored records with 0; with
    --setups B,A the top-level figures were setup B's while the docstring said A's."""
    settings = EvalSettings(tasks=["niah_single"], lengths=[1024], samples=2, methods=parse_methods("dense"),
                            likelihood_samples=2, likelihood_tokens=0, setups=["B", "A"])
    lik = {"ppl": 3.0, "nll": 1.0, "top1": 1.0, "kl": 0.0, "forced_tokens": 8}
    records = [_rec("task", "dense", i, score=1.0) for i in range(2)] + [
        _rec("task", "dense", i, setup="B", score=0.0) for i in range(2)] + [
        _rec("likelihood", "dense", i, **lik) for i in range(2)]
    summary = summarize(records, settings)
    dense = summary[1024]["dense"]
    assert dense["likelihood_forced_tokens"] == [8]
    assert dense["accuracy"] == {"niah_single": 1.0} == dense["tasks"]["A"]["accuracy"]
    text = format_summary(summary, settings)
    assert "#### Likelihood (2 documents, 8 teacher-forced tokens each)" in text


def test_equal_ms_picks_by_the_paired_difference_when_variants_cover_different_documents():
    """The least-KL pick compared variants' means over different documents (one recorded on the two
    easiest only), and printed TopK's mean over all its documents beside the variant's over two."""
    from magicpig_jax.eval.report import equal_ms_comparison

    settings = EvalSettings(tasks=[], lengths=[1024], samples=1,
                            methods=parse_methods("dense,magicpig:10x150,magicpig:9x150,topk"),
                            likelihood_samples=4, likelihood_tokens=8)
    lik = {"ppl": 3.0, "nll": 1.0, "top1": 1.0}
    kls = {"dense": [0.0] * 4, "topk": [0.01, 0.01, 0.1, 0.1], "magicpig:10x150": [0.005, 0.005, 0.05, 0.05],
           "magicpig:9x150": [0.009, 0.009]}  # half TopK's KL everywhere; just under TopK's, on two documents
    ms = {"dense": 40.0, "topk": 30.0, "magicpig:10x150": 20.0, "magicpig:9x150": 20.0}
    records = [_rec("likelihood", m, i, **{**lik, "ms_per_step": ms[m] + i, "kl": kl,
                                          "attention_runs_on": f"{m} (host op)"})
               for m, v in kls.items() for i, kl in enumerate(v)]
    (row,) = equal_ms_comparison(records, settings)[1024]
    assert row["method"] == "magicpig:10x150" and row["documents"] == 4 and row["kl_diff"][0] == pytest.approx(-0.0275)
    assert row["topk_kl"] == pytest.approx(0.055) and row["kl"] == pytest.approx(0.0275)
    records = [r for r in records if not (r["method"] == "magicpig:10x150")]
    (row,) = equal_ms_comparison(records, settings)[1024]  # the one left: TopK over the same two documents
    assert row["method"] == "magicpig:9x150" and row["documents"] == 2
    assert row["topk_kl"] == pytest.approx(0.01) and row["topk_ms"] == pytest.approx(30.5)
    assert row["kl"] - row["topk_kl"] == pytest.approx(row["kl_diff"][0])


def test_an_infinite_kl_gives_no_interval_and_no_verdict():
    """+inf passed the NaN guard: the mean was inf while the interval and the verdict ('lower KL')
    silently left that document out."""
    from magicpig_jax.eval.report import equal_ms_comparison

    settings = EvalSettings(tasks=[], lengths=[1024], samples=1, methods=parse_methods("dense,magicpig,topk"),
                            likelihood_samples=4, likelihood_tokens=8)
    lik = {"ppl": 3.0, "nll": 1.0, "top1": 1.0}
    kls = {"dense": [0.0] * 4, "magicpig:10x150": [0.005, 0.006, 0.007, math.inf], "topk": [0.010, 0.011, 0.012, 0.013]}
    ms = {"dense": 40.0, "magicpig:10x150": 20.0, "topk": 30.0}
    records = [_rec("likelihood", m, i, **{**lik, "ms_per_step": ms[m], "kl": kl,
                                          "attention_runs_on": f"{m} (host op)"})
               for m, v in kls.items() for i, kl in enumerate(v)]
    (row,) = equal_ms_comparison(records, settings)[1024]
    assert row["verdict"] == "NaN KL" and all(math.isnan(x) for x in row["kl_diff"])
    s = summarize(records, settings)[1024]["magicpig:10x150"]
    assert s["kl"] == math.inf and all(math.isnan(x) for x in s["kl_ci"])
    assert all(math.isnan(x) for x in s["kl_minus_topk"])


def test_the_task_heading_gives_the_prompts_real_lengths():
    """A haystack grows by whole sentences, so a 1K sample's prompt may fill only 85% of it (a fresh
    reviewer's count); the heading gives the shortest and longest whole prompt (setup B: the document
    plus its decoded question part), and the summary records them."""
    settings = EvalSettings(tasks=["niah_single"], lengths=[1024], samples=2, methods=parse_methods("dense"),
                            likelihood_samples=0, setups=["A", "B"])
    records = [_rec("task", "dense", 0, score=1.0, prompt_tokens=871),
               _rec("task", "dense", 1, score=1.0, prompt_tokens=1003),
               *[_rec("task", "dense", i, setup="B", score=1.0, prompt_tokens=n - 40, question_tokens=40)
                 for i, n in enumerate((871, 1003))]]
    s = summarize(records, settings)
    assert s[1024]["dense"]["tasks"]["B"]["prompt_tokens_range"] == [871, 1003]
    text = format_summary(s, settings)
    assert "#### Tasks, setup A (2 samples per task; prompts of 871–1003 tokens before the answer)" in text
    assert "#### Tasks, setup B (2 samples per task; prompts of 871–1003 tokens before the answer)" in text
