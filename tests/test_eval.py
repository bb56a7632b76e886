"""Evaluation harness: RULER-style generators, RULER scoring, likelihood metrics, the resumable runner.

The runner logic runs on the tiny random model of ``tests/_tiny.py`` with a character-level
tokenizer; one small configuration of the real command runs on the embedded SmolLM2.
Haystack: ``/usr/share/common-licenses`` (no apt package needed).
"""

from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from magicpig_jax import cli
from magicpig_jax.eval import corpus, tasks
from magicpig_jax.eval.likelihood import compare_to_dense, log_softmax, make_likelihood_sample
from magicpig_jax.eval.run import (
    EvalSettings,
    ResultStore,
    finish,
    parse_lengths,
    parse_methods,
    run_eval,
)
from magicpig_jax.eval.tasks import (
    TASKS,
    approx_token_count,
    make_sample,
    postprocess_pred,
    score,
    string_match_all,
    string_match_part,
)
from magicpig_jax.io.loader import LoadedModel
from magicpig_jax.io.tokenizer import Tokenizer
from tests._tiny import TINY, tiny_model

HAY = "licenses"


# --- generators -------------------------------------------------------------------------------

@pytest.mark.parametrize("task", TASKS)
def test_generator_deterministic_and_answer_in_prompt(task):
    length = 3000
    a = make_sample(task, length, 0, approx_token_count, seed=1, haystack=HAY)
    b = make_sample(task, length, 0, approx_token_count, seed=1, haystack=HAY)
    c = make_sample(task, length, 1, approx_token_count, seed=1, haystack=HAY)
    assert a == b
    assert (a.prompt, a.outputs) != (c.prompt, c.outputs)
    assert a.outputs and all(o in a.prompt for o in a.outputs)
    n = approx_token_count(a.prompt, a.answer_prefix)
    assert 0.85 * (length - a.max_new_tokens) < n <= length - a.max_new_tokens


def test_niah_needles_and_answers():
    for task, (num_k, num_v, num_q) in tasks._NIAH.items():
        s = make_sample(task, 2000, 3, approx_token_count, haystack=HAY)
        needles = re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.", s.prompt)
        assert len(needles) == num_k * num_v
        assert len({k for k, _ in needles}) == num_k
        assert len(s.outputs) == num_q * num_v
        asked = re.search(r"What are all the special magic numbers for (.*) mentioned", s.prompt).group(1)
        for key, value in needles:  # the asked keys' values are exactly the expected outputs
            assert (value in s.outputs) == (key in asked)
        assert all(s.prompt.count(v) == 1 for v in s.outputs)  # values never occur elsewhere
        assert asked in s.answer_prefix


def test_vt_chain():
    s = make_sample("vt", 2000, 0, approx_token_count, haystack=HAY)
    stmts = re.findall(r"VAR ([A-Z]{5}) = (VAR ([A-Z]{5})|\d{5})\.", s.prompt)
    assert len(stmts) == 5 and list(s.outputs) == [x[0] for x in stmts]
    value = stmts[0][1]
    assert value.isdigit() and f"assigned the value {value}" in s.prompt
    for (_, _, prev), (name, _, _) in zip(stmts[1:], stmts[:-1], strict=True):
        assert prev == name  # each hop reads the previous variable


def test_cwe_and_fwe_frequencies():
    s = make_sample("cwe", 3000, 0, approx_token_count, haystack=HAY)
    listed = s.prompt.split("\n")[-2]  # the numbered list of the real question
    counts = Counter(re.findall(r"\d+\. ([a-z]+)", listed))
    top = {w for w, _ in counts.most_common(10)}
    assert top == set(s.outputs) and min(counts[w] for w in s.outputs) == 6
    assert max(c for w, c in counts.items() if w not in s.outputs) == 1
    f = make_sample("fwe", 3000, 0, approx_token_count, haystack=HAY)
    words = Counter(f.prompt.split("coded words. ")[1].split("\nQuestion")[0].split())
    ranked = [w for w, _ in words.most_common(4)]
    assert ranked[0] == "..." and ranked[1:] == list(f.outputs)


def test_too_short_context_is_an_error():
    with pytest.raises(ValueError, match="too small"):
        make_sample("cwe", 100, 0, approx_token_count, haystack=HAY)
    with pytest.raises(ValueError, match="unknown task"):
        make_sample("qa", 1000, 0, approx_token_count, haystack=HAY)


def test_corpus_sources(monkeypatch, tmp_path):
    sents = corpus.load_sentences(HAY)
    assert len(sents) > 500 and all(s == " ".join(s.split()) for s in sents[:100])
    assert set(corpus.word_lists()) == {"nouns", "adjectives", "verbs"}
    monkeypatch.setattr(corpus, "JARGON_PATH", tmp_path / "missing.txt.gz")
    corpus.load_prose.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match="apt-get install -y jargon-text"):
            corpus.load_prose("jargon")
    finally:
        corpus.load_prose.cache_clear()
    with pytest.raises(FileNotFoundError, match="neither"):
        corpus.load_prose(str(tmp_path / "nope.txt"))


# --- scoring ----------------------------------------------------------------------------------

def test_scoring_matches_ruler():
    # RULER: sum over refs of [ref.lower() in pred.lower()] / len(refs)
    assert string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321", "1111111"]) == 2 / 3
    assert string_match_all("ANSWER: Apple, banana", ["apple", "Banana"]) == 1.0
    assert string_match_all("", ["x"]) == 0.0
    assert string_match_all("12345678", ["1234567"]) == 1.0  # substring semantics, as RULER
    assert string_match_part("only the second", ["first", "second"]) == 1.0
    assert string_match_part("neither", ["first", "second"]) == 0.0
    assert postprocess_pred("  a\tb\x00c \n") == "a\nb\nc"
    assert score("vt", " they are: ABCDE, FGHIJ", ["ABCDE", "FGHIJ", "KLMNO", "PQRST"]) == 0.5
    with pytest.raises(ValueError):
        string_match_all("x", [])


# --- likelihood metrics -----------------------------------------------------------------------

def test_likelihood_metrics():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 11))
    ld = log_softmax(logits)
    t = [1, 2, 3, 4, 5, 6]
    m = compare_to_dense(ld, ld, t)
    assert m["kl"] == 0.0 and m["top1"] == 1.0
    assert m["nll"] == pytest.approx(-np.mean(ld[np.arange(6), t]))
    assert m["ppl"] == pytest.approx(np.exp(m["nll"]))
    other = log_softmax(logits + rng.normal(size=logits.shape))
    m2 = compare_to_dense(other, ld, t)
    p = np.exp(ld)
    assert m2["kl"] == pytest.approx(np.mean((p * (ld - other)).sum(-1))) and m2["kl"] > 0
    s = make_likelihood_sample(lambda x: [ord(c) % 97 for c in x], 500, 0, haystack=HAY, forced=16)
    assert len(s.ids) == 500 and len(s.targets) == 16 and s.prefix + s.targets == list(s.ids)


# --- argument parsing -------------------------------------------------------------------------

def test_parse_methods_and_lengths():
    ms = parse_methods("oracle,topk,dense,magicpig:8x75,quest")
    assert [m.label for m in ms] == ["dense", "magicpig:10x150", "magicpig:8x75", "topk", "quest", "oracle"]
    assert [m.label for m in parse_methods("quest:0.05,dense")] == ["dense", "quest:0.05"]  # fixed budget: no ref
    assert parse_methods("magicpig:11x300")[0].K == 11
    assert parse_methods("magicpig-ref:4x8")[0].backend == "magicpig-ref"
    for bad in ("flash", "magicpig:10", "topk:0", "dense,dense", "magicpig:40x10"):
        with pytest.raises(ValueError):
            parse_methods(bad)
    assert parse_lengths("2K,4k,8192") == [2048, 4096, 8192]
    with pytest.raises(ValueError):
        parse_lengths("2Q")


def test_cli_eval_is_wired(capsys, tmp_path):
    assert cli.main(["eval", "--tasks", "bogus", "--out", str(tmp_path)]) == 2
    assert "unknown task" in capsys.readouterr().err
    assert cli.main(["eval", "--methods", "dense,flash", "--out", str(tmp_path)]) == 2


# --- the runner on the tiny model -------------------------------------------------------------

def char_model(seed: int = 0) -> LoadedModel:
    """The tiny random model with a character-level tokenizer (96 characters + EOS = 97 ids)."""
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    assert len(vocab) == TINY.vocab_size
    backend = HFTokenizer(models.WordLevel(vocab=vocab, unk_token=" "))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if add_generation_prompt %}\n{% endif %}"
    tok = Tokenizer(backend, chat_template=template, eos_token_ids=())  # no EOS: every decode runs to the end
    m = tiny_model(seed)
    return LoadedModel(m.module, m.config, tok, m.source)


class Interrupt(Exception):
    pass


def _settings(**kw) -> EvalSettings:
    base = dict(tasks=["niah_single", "vt"], lengths=[768], samples=2,
                methods=parse_methods("dense,magicpig:4x8,topk", "magicpig:4x8"), haystack=HAY,
                likelihood_tokens=8, likelihood_samples=1, max_new_tokens=4, budget_from="magicpig:4x8",
                page_size=64)  # coarse budget rounding: fewer TopK/oracle compilations
    base.update(kw)
    return EvalSettings(**base)


def test_runner_resumes_without_loss_or_duplicates(tmp_path):
    model = char_model()
    settings = _settings()
    out = tmp_path / "run"
    seen: list[dict] = []

    def stop_after_7(rec):
        seen.append(rec)
        if len(seen) == 7:
            raise Interrupt

    with pytest.raises(Interrupt):
        run_eval(model, settings, out, on_record=stop_after_7, progress=False)
    first = (out / "results.jsonl").read_text().splitlines()
    assert len(first) == 7
    # a crash mid-write leaves half a line: it is dropped on resume
    with open(out / "results.jsonl", "a") as f:
        f.write('{"kind": "task", "trunc')
    again: list[dict] = []
    store = run_eval(model, settings, out, on_record=again.append, progress=False)
    lines = (out / "results.jsonl").read_text().splitlines()
    total = (2 * 2 + 1) * 3  # (samples x tasks + likelihood samples) x methods
    assert len(again) == total - 7 and len(lines) == total and lines[:7] == first
    recs = [json.loads(x) for x in lines]
    keys = [(r["kind"], r["task"], r["length"], r["index"], r["method"]) for r in recs]
    assert len(set(keys)) == total and len(store.records) == total
    # complete: a third run computes nothing
    nothing: list[dict] = []
    run_eval(model, settings, out, on_record=nothing.append, progress=False)
    assert nothing == []
    # values
    by = {k: r for k, r in zip(keys, recs, strict=True)}
    for r in recs:
        assert r["prompt_tokens"] <= 768 and 0 <= r.get("score", 0) <= 1
        if r["method"] == "dense":
            assert r["sampled_fraction"] == 1.0
        else:
            assert 0 < r["sampled_fraction"] < 1
        if r["backend"] == "topk":  # budget = the reference's measured count, in whole pages
            ref = by[(r["kind"], r["task"], r["length"], r["index"], "magicpig:4x8")]
            assert r["budget_measured_keys"] == pytest.approx(ref["mean_sampled_keys"])
            assert r["budget"] % 64 == 0 and abs(r["budget"] - ref["mean_sampled_keys"]) <= 32
    lik = {r["method"]: r for r in recs if r["kind"] == "likelihood"}
    assert lik["dense"]["kl"] == 0.0 and lik["dense"]["top1"] == 1.0
    assert all(r["kl"] >= 0 and r["ppl"] > 1 for r in lik.values())
    text = finish(store, settings, out, "tiny")
    assert "| dense |" in text and "magicpig:4x8" in text
    for name in ("summary.md", "summary.json", "accuracy_vs_cost.png", "kl_vs_cost.png", "runs.jsonl"):
        assert (out / name).stat().st_size > 0
    # other settings in the same folder are refused
    with pytest.raises(ValueError, match="other settings"):
        run_eval(model, _settings(seed=5), out, progress=False)


def test_result_store_drops_corrupt_tail(tmp_path):
    p = tmp_path / "r.jsonl"
    good = {"kind": "task", "task": "vt", "length": 1, "index": 0, "method": "dense"}
    p.write_text(json.dumps(good) + "\n" + "{not json}\n" + json.dumps({**good, "index": 1}) + "\n")
    store = ResultStore(p)
    assert len(store.records) == 1 and p.read_text() == json.dumps(good) + "\n"
    store.append({**good, "index": 2})
    assert len(ResultStore(p).records) == 2
    with pytest.raises(RuntimeError, match="duplicate"):
        store.append(good)


# --- the real command on the embedded model ---------------------------------------------------

@pytest.mark.slow
def test_real_model_small_eval(tmp_path, capsys):
    out = tmp_path / "real"
    # a fixed TopK budget keeps this to one TopK compilation (the measured budget is tested above)
    rc = cli.main(["eval", "--tasks", "niah_single", "--lengths", "512", "--samples", "1",
                   "--methods", "dense,magicpig:10x150,topk:32", "--likelihood-tokens", "6",
                   "--max-new-tokens", "8", "--haystack", HAY, "--out", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "### Context 512 tokens" in printed and "| magicpig:10x150 |" in printed
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 6
    task = {r["method"]: r for r in recs if r["kind"] == "task"}
    lik = {r["method"]: r for r in recs if r["kind"] == "likelihood"}
    assert task["dense"]["score"] == 1.0  # SmolLM2 finds one needle in 512 tokens of license text
    assert task["dense"]["outputs"][0] in task["dense"]["prediction"]
    for r in recs:
        assert 400 <= r["prompt_tokens"] <= 512
        assert r["sampled_fraction"] == 1.0 if r["method"] == "dense" else 0 < r["sampled_fraction"] < 0.2
    mp = task["magicpig:10x150"]
    assert set(map(int, mp["sampled_fraction_per_layer"])) == set(range(30)) - {0, 15}
    assert lik["dense"]["kl"] == 0.0 and lik["dense"]["top1"] == 1.0
    assert 0 < lik["magicpig:10x150"]["kl"] < 1 and 0 < lik["topk:32"]["kl"] < 1
    assert all(1 < r["ppl"] < 1000 for r in lik.values())
    assert (out / "accuracy_vs_cost.png").is_file() and (out / "kl_vs_cost.png").is_file()


def test_llama_cpp_peer_validates_before_loading(tmp_path, monkeypatch):
    from magicpig_jax.eval import bench_decode
    from magicpig_jax.eval.peer import llama_cpp_decode

    with pytest.raises(ValueError, match="steps"):
        llama_cpp_decode(tmp_path / "model.gguf", [1, 2, 3], 1)
    with pytest.raises(ValueError, match="prompt_ids"):
        llama_cpp_decode(tmp_path / "model.gguf", [], 4)
    monkeypatch.setattr(bench_decode, "llama_cpp_available", lambda: False)
    with pytest.raises(SystemExit):
        bench_decode.main(["--peer", "llama.cpp", "--lengths", "128"])
