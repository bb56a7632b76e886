"""magicpig_jax.eval.run: the resumable runner and the ``magicpig-jax eval`` command.

The runner logic runs on the tiny random model of ``tests/_tiny.py`` with a character-level
tokenizer; one small configuration of the real command runs on the embedded SmolLM2.
Haystack: ``/usr/share/common-licenses`` (no apt package needed).
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from magicpig_jax import cli
from magicpig_jax.eval.cost import step_bytes
from magicpig_jax.eval.methods import parse_methods
from magicpig_jax.eval.report import finish
from magicpig_jax.eval.run import EvalSettings, run_eval
from magicpig_jax.eval.store import ResultStore
from magicpig_jax.io.loader import LoadedModel
from magicpig_jax.io.tokenizer import Tokenizer
from tests._tiny import TINY, tiny_model

HAY = "licenses"


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
                page_size=64, setups=["A", "B"])  # coarse budget rounding: fewer TopK/oracle compilations
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
    total = (2 * 2 * 2 + 1) * 3  # (samples x tasks x setups + likelihood samples) x methods
    assert len(again) == total - 7 and len(lines) == total and lines[:7] == first
    recs = [json.loads(x) for x in lines]
    keys = [(r["kind"], r["task"], r["length"], r["index"], r["method"], r.get("setup", "A")) for r in recs]
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
            ref = by[(r["kind"], r["task"], r["length"], r["index"], "magicpig:4x8", r.get("setup", "A"))]
            assert r["budget_measured_keys"] == pytest.approx(ref["mean_sampled_keys"])
            assert r["budget"] % 64 == 0 and abs(r["budget"] - ref["mean_sampled_keys"]) <= 32
        assert r["ms_per_step"] > 0 and r["bytes_per_step"]["total"] > 0
        if r["backend"] == "magicpig":  # the static set's tail holds the local window and the generated tokens
            context = r["prompt_tokens"] + 1 + (r["decode_steps"] - 1) / 2
            dense_layers = settings.fingerprint(model)["dense_layers"]
            shape = dict(num_layers=TINY.num_layers, num_heads=TINY.num_heads, num_kv_heads=TINY.num_kv_heads,
                         head_dim=TINY.head_dim, context=context, dense_layers=dense_layers,
                         fraction_per_layer=r["sampled_fraction_per_layer"], num_sink=settings.num_sink,
                         num_local=settings.num_local, kv_bytes=4, K=4, L=8)
            with_tail = step_bytes("magicpig", **shape, unhashed_tail=settings.num_local + (r["decode_steps"] + 1) / 2)
            assert r["bytes_per_step"] == pytest.approx(with_tail)
            assert with_tail["total"] > step_bytes("magicpig", **shape)["total"]  # more exact keys than 4 + 64
        if r["kind"] == "task":  # setup B decodes the question: a shorter prefill, forced question tokens
            other = by[(*keys[recs.index(r)][:5], "B" if r["setup"] == "A" else "A")]
            a, b = (r, other) if r["setup"] == "A" else (other, r)
            assert a["question_tokens"] == 0 and b["question_tokens"] > 10
            assert b["prompt_tokens"] + b["question_tokens"] == a["prompt_tokens"]
    lik = {r["method"]: r for r in recs if r["kind"] == "likelihood"}
    assert lik["dense"]["kl"] == 0.0 and lik["dense"]["top1"] == 1.0
    assert all(r["kl"] >= 0 and r["ppl"] > 1 for r in lik.values())
    text = finish(store, settings, out, "tiny")
    assert "| dense |" in text and "magicpig:4x8" in text
    assert "#### Tasks, setup B" in text
    for name in ("summary.md", "summary.json", "accuracy_vs_cost.png", "kl_vs_cost.png", "kl_vs_ms.png",
                 "accuracy_vs_ms.png", "runs.jsonl"):
        assert (out / name).stat().st_size > 0
    # other settings in the same folder are refused
    with pytest.raises(ValueError, match="other settings"):  # (seed 5's vt sample 1 does not fit 768: refused too)
        run_eval(model, _settings(page_size=32), out, progress=False)


def test_question_split_finds_the_last_line():
    from magicpig_jax.eval.run import prompt_ids, question_split

    model = char_model()
    prompt = "a long document\nWhat is the magic number?"
    ids = prompt_ids(model, prompt, "Answer:")
    t = question_split(model.tokenizer.decode, ids, "What is the magic number?")
    assert model.tokenizer.decode(ids[:t]).endswith("a long document\n")
    assert model.tokenizer.decode(ids[t:]).startswith("What is the magic number?")
    with pytest.raises(ValueError, match="not in the prompt"):
        question_split(model.tokenizer.decode, ids, "Where?")


def test_a_per_layer_file_the_host_index_cannot_take_is_named(tmp_path):
    from magicpig_jax.attention import LayerConfigs, MagicPIGConfig
    from magicpig_jax.eval.run import _method_spec

    path = LayerConfigs.uniform(MagicPIGConfig(K=4, L=5000, num_local=16), 3, [0]).save(tmp_path / "wide.json")
    with pytest.raises(ValueError, match=re.escape(f"method 'magicpig@{path}': layer 1: the host index takes K in "
                                                   "[1, 16] and L in [2, 4096], got K=4, L=5000")):
        parse_methods(f"magicpig@{path}")  # the command line's parse, before any model loads
    from magicpig_jax.eval.methods import Method

    m = Method("magicpig@wide", "magicpig", config_file=str(path))  # the Python API's, at the spec
    with pytest.raises(ValueError, match=f"^magicpig@wide \\({re.escape(str(path))}\\): L must be in \\[2, 4096\\]"):
        _method_spec(char_model(), _settings(num_local=16), (0,), m, None, 768)


@pytest.mark.parametrize(("kw", "named"), [
    ({"likelihood_tokens": 1}, r"--likelihood-tokens must be 0 \(no likelihood task\) or >= 2"),
    ({"likelihood_tokens": 768}, r"--likelihood-tokens \(768\) must be below every length"),
    ({"likelihood_tokens": 700}, r"leaves a prefix of 68 tokens at length 768, not longer than the static set"),
    ({"max_new_tokens": 1}, "--max-new-tokens 1 with setup A"),
    ({"lengths": [48], "likelihood_tokens": 0}, "a context of 48 tokens .* is too small"),  # config.json was written
])
def test_settings_that_decode_nothing_sparsely_are_refused_before_writing(tmp_path, kw, named):
    """Each reported every method equal to dense (KL 0) or failed after the task samples, with
    config.json pinning the bad value."""
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=named):
        run_eval(char_model(), _settings(**kw), out, progress=False)
    assert not out.exists()


def test_a_tasks_only_folder_of_an_older_version_resumes(tmp_path):
    """Folders written before likelihood_starts was recorded were refused even when neither run had a
    likelihood document: a setting nothing reads."""
    out = tmp_path / "run"
    settings = _settings(tasks=["niah_single"], samples=1, likelihood_tokens=0, methods=parse_methods("dense"),
                         setups=["A"])
    run_eval(char_model(), settings, out, progress=False)
    config = json.loads((out / "config.json").read_text())
    del config["fingerprint"]["likelihood_starts"]  # as an older version wrote it (no "unread" list either)
    del config["unread"]
    (out / "config.json").write_text(json.dumps(config))
    run_eval(char_model(), dataclasses.replace(settings, samples=2), out, progress=False)
    assert len([r for r in ResultStore(out / "results.jsonl").records.values() if r.get("task") == "niah_single"]) == 2
    with pytest.raises(ValueError, match="likelihood_starts"):  # a likelihood run still is refused
        run_eval(char_model(), dataclasses.replace(settings, likelihood_tokens=8), out, progress=False)


def test_a_run_without_task_samples_is_not_refused_for_the_tasks_haystack():
    from magicpig_jax.eval.run import _check_before_writing

    model = char_model()
    small = _settings(lengths=[48], likelihood_tokens=8, num_local=8)
    with pytest.raises(ValueError, match="is too small for the smallest haystack"):
        _check_before_writing(model, small, (0,))
    _check_before_writing(model, dataclasses.replace(small, samples=0), (0,))  # likelihood documents only


def test_one_new_token_with_setup_a_is_accepted_when_every_method_is_dense():
    """Dense answering as dense is what is asked; only a sparse method's records would be vacuous."""
    from magicpig_jax.eval.run import _check_likelihood_and_answers

    model = char_model()
    _check_likelihood_and_answers(model, _settings(max_new_tokens=1, methods=parse_methods("dense")))
    _check_likelihood_and_answers(model, _settings(max_new_tokens=1, setups=["B"]))
    with pytest.raises(ValueError, match="every sparse method would answer as dense"):
        _check_likelihood_and_answers(model, _settings(max_new_tokens=1, setups=["B", "A"]))


def test_decodes_long_enough_to_append_generated_keys_are_refused():
    """The byte count holds every generated token in the static tail; past 2 x GENERATION_BUFFER tokens
    the decoder appends them to the index (a shorter static set, a longer hashed range), so a longer
    --likelihood-tokens or --max-new-tokens recorded bytes that the decode did not read."""
    from magicpig_jax.eval.run import _check_likelihood_and_answers

    model = char_model()
    with pytest.raises(ValueError, match=r"--max-new-tokens \(512\) must be at most 511"):
        _check_likelihood_and_answers(model, _settings(max_new_tokens=512))
    with pytest.raises(ValueError, match=r"--likelihood-tokens \(600\) must be at most 511"):
        _check_likelihood_and_answers(model, _settings(lengths=[2048], likelihood_tokens=600, tasks=[]))
    _check_likelihood_and_answers(model, _settings(max_new_tokens=600, tasks=[]))  # no task decodes an answer
    _check_likelihood_and_answers(model, _settings(max_new_tokens=None))  # each task's own answer length


def test_setup_b_counts_its_question_tokens_in_the_decode_length():
    """Setup B decodes the question part (teacher-forced) before the answer: --max-new-tokens 500 is within
    the limit alone, not with the question's tokens (a fresh reviewer's finding: every sparse layer
    appended generated keys to its index while the byte count assumed none)."""
    from magicpig_jax.eval.run import _check_before_writing

    model = char_model()
    settings = _settings(tasks=["niah_single"], lengths=[2048], max_new_tokens=500, likelihood_tokens=0,
                         setups=["A"])
    _check_before_writing(model, settings, (0,))
    with pytest.raises(ValueError, match=r"setup B of niah_single at 2048 \(sample 0: \d+ question tokens \+ 500 new "
                                         r"tokens\) must be at most 511 decoded tokens"):
        _check_before_writing(model, dataclasses.replace(settings, setups=["A", "B"]), (0,))


def test_runs_log_records_the_checkout_the_run_started_from(tmp_path, monkeypatch):
    """runs.jsonl named the source as the run ended: a commit made during a run was recorded as its
    source (a fresh reviewer's finding; the benchmarks had the same defect)."""
    import magicpig_jax.eval.rss as rss

    state = {"committed": False}
    monkeypatch.setattr(rss, "source_revision", lambda: "bbbbbbb" if state["committed"] else "aaaaaaa")
    settings = _settings(tasks=["niah_single"], samples=1, likelihood_tokens=0, methods=parse_methods("dense"),
                         setups=["A"])
    run_eval(char_model(), settings, tmp_path / "run", progress=False,
             on_record=lambda rec: state.update(committed=True))  # a commit lands during the run
    (entry,) = [json.loads(line) for line in (tmp_path / "run" / "runs.jsonl").read_text().splitlines()]
    assert state["committed"] and entry["machine"]["source"] == "aaaaaaa"
