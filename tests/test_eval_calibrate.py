"""magicpig_jax.eval.calibrate: the choice of per-layer configs (assignments ordered by measured cost),
the end-to-end calibration on the tiny model (the chosen configs meet the KL budget when decoded
again), the JSON file, the check that keeps calibration texts out of evaluation haystacks, and the
command line (calibrate, generate --magicpig-config)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from magicpig_jax import cli
from magicpig_jax.attention import LayerConfigs, MagicPIGConfig
from magicpig_jax.eval import calibrate as cal
from magicpig_jax.eval.calibrate import LayerCosts, assignments, to_layer_configs
from tests.test_eval_run import char_model

TEXT = " ".join(f"Paragraph {i} says that the quick brown fox jumps over the lazy dog number {i * 7}."
                for i in range(40))


def test_assignments_trade_cost_for_error():
    layers = [
        LayerCosts(ms={"dense": 10.0, "4x8": 1.0, "6x16": 2.0}, error={"dense": 0.0, "4x8": 0.5, "6x16": 0.1},
                   fraction={}, bytes={"dense": 1.0, "4x8": 3.0, "6x16": 2.0}),
        LayerCosts(ms={"dense": 10.0, "4x8": 1.0, "6x16": 2.0}, error={"dense": 0.0, "4x8": 0.01, "6x16": 0.005},
                   fraction={}, bytes={"dense": 1.0, "4x8": 3.0, "6x16": 2.0}),
    ]
    assert assignments(layers, kind="bytes")[0] == ("dense", "dense")  # dense reads the fewest bytes here
    order = assignments(layers, lambdas=[1e-3, 5.0, 50.0, 1e6])
    assert order[0] == ("4x8", "4x8") and order[-1] == ("dense", "dense")
    assert ("6x16", "4x8") in order  # at λ = 5 the noisy layer buys larger tables first
    costs = [sum(c.ms[p] for c, p in zip(layers, a, strict=True)) for a in order]
    assert costs == sorted(costs)
    lc = to_layer_configs(("dense", "6x16"), MagicPIGConfig(num_local=8, seed=2))
    assert lc == LayerConfigs(((0, "dense"), (1, MagicPIGConfig(K=6, L=16, num_local=8, seed=2))))


@pytest.fixture(scope="module")
def calibrated():
    model = char_model()
    # bytes: a deterministic cost (at 600 keys the measured ms of the tiny model's dense attention is the least)
    lc, report = cal.calibrate(model, TEXT, kl_budget=0.05, length=600, forced_tokens=12,
                               candidates=((4, 8), (6, 16)), num_local=16, probes=2, repeats=1, max_evals=4,
                               cost="bytes", progress=False)
    return model, lc, report


def test_calibration_meets_the_budget_when_decoded_again(calibrated):
    from magicpig_jax.eval.forcing import forced_decode
    from magicpig_jax.eval.likelihood import LogitsRecorder, compare_to_dense
    from magicpig_jax.generation import prefill

    model, lc, report = calibrated
    assert lc.num_layers == model.config.num_layers and report["measured_kl"] <= 0.05
    assert lc.sparse_layers and report["attention_bytes_per_step"] < report["dense_attention_bytes_per_step"]
    assert [row["choice"] for row in report["per_layer"]] == [
        "dense" if lc.config(i) == "dense" else f"{lc.config(i).K}x{lc.config(i).L}" for i in range(lc.num_layers)]
    for row in report["per_layer"]:
        assert set(row["ms"]) == {"dense", "4x8", "6x16"} and all(v > 0 for v in row["ms"].values())
        assert row["bytes"]["4x8"] < row["bytes"]["dense"]
        assert row["error"]["dense"] == 0.0 and all(0 <= v for v in row["error"].values())
    assert report["tried"] and all(t["kl"] >= 0 for t in report["tried"])
    ids = model.tokenizer.encode(TEXT)[:600]
    state = prefill(model, [ids[:588]], 12)
    recs = {}
    for name, config in (("dense", None), ("magicpig", lc)):
        rec = LogitsRecorder(12)
        forced_decode(model, state, forced_tokens=[ids[588:]], logits_callback=rec, attention=name, config=config,
                      max_new_tokens=12, stop_on_eos=False)
        recs[name] = rec.logp
    kl = compare_to_dense(recs["magicpig"], recs["dense"], ids[588:])["kl"]
    assert kl == pytest.approx(report["measured_kl"], abs=1e-6)


def test_budget_checks():
    with pytest.raises(ValueError, match="kl-budget"):
        cal.calibrate(char_model(), TEXT, kl_budget=0.0, progress=False)
    with pytest.raises(ValueError, match="fewer than"):
        cal.calibrate(char_model(), "short", kl_budget=0.1, length=600, forced_tokens=12, progress=False)
    # the forced tokens are decoded after the prefix: a length past the context is refused up front (it once
    # failed after the dense prefill with "no logits recorded", the decode having stopped at the context)
    model = char_model()
    ctx = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"--length {ctx + 1} is past the model's context of {ctx}"):
        cal.calibrate(model, TEXT * 50, kl_budget=0.1, length=ctx + 1, forced_tokens=12, progress=False)
    # a prefix inside the static set samples no key: every candidate would measure KL 0 at no cost
    with pytest.raises(ValueError, match=r"the prefix \(--length - --forced-tokens = 32\) must be longer than "
                                         r"--num-sink \+ --num-local = 68"):
        cal.calibrate(model, TEXT, kl_budget=0.1, length=40, forced_tokens=8, progress=False)
    # one forced token is predicted by the dense prefill: every assignment measured KL 0 (a file
    # claiming its budget met, 147x over it when re-measured over 32)
    with pytest.raises(ValueError, match=r"--forced-tokens must be >= 2: the first forced token"):
        cal.calibrate(model, TEXT, kl_budget=0.1, length=600, forced_tokens=1, progress=False)


def test_the_api_refuses_what_the_command_refuses_before_any_model_work(monkeypatch):
    """calibrate() checked only some of its arguments (a fresh reviewer's finding): repeats=0 wrote an
    all-dense file of NaN costs, probes=0 failed after the prefill, no candidate or max_evals=0 gave
    all-dense, an infinite budget passed; forced tokens past 511 were priced as if no generated key
    were appended to the index. Each is now refused before the prefill."""
    model = char_model()
    monkeypatch.setattr("magicpig_jax.generation.prefill", lambda *a, **k: pytest.fail("the prefill ran"))
    ok = dict(kl_budget=0.1, length=700, forced_tokens=12, candidates=((4, 8),), num_local=16, probes=2,
              repeats=1, max_evals=2, progress=False)
    for change, error, message in (
            ({"repeats": 0}, ValueError, "--repeats must be >= 1, got 0"),
            ({"probes": 0}, ValueError, "--probes must be >= 1, got 0"),
            ({"max_evals": 0}, ValueError, "--max-evals must be >= 1, got 0"),
            ({"probes": 2.0}, TypeError, "--probes must be an int, got float 2.0"),
            ({"candidates": ()}, ValueError, "--candidates is empty"),
            ({"candidates": ((4, 8), (4, 8))}, ValueError, "--candidates lists 4x8 more than once"),
            ({"candidates": (4, 8)}, TypeError, r"each candidate must be a \(K, L\) pair, got 4"),
            ({"candidates": ((0, 8),)}, ValueError, r"--candidates 0x8: K must be in \[1, 16\] \(the host index\)"),
            ({"candidates": ((4, 8.0),)}, TypeError, "--candidates 4x8.0: L must be an int"),
            ({"kl_budget": float("inf")}, ValueError, "--kl-budget must be a positive finite number, got inf"),
            ({"forced_tokens": 600}, ValueError, r"--forced-tokens \(600\) must be at most 511: a longer decode"),
            ({"cost": "flops"}, ValueError, "--cost must be one of")):
        with pytest.raises(error, match=message):
            cal.calibrate(model, TEXT, **{**ok, **change})


def test_windowed_layers_stay_dense():
    """A layer whose sliding window (64) is shorter than the calibration run keeps only the exact
    choice, so the file's configs decode (decode_spec refuses such a layer sparse); a model whose
    every layer has one is refused before any work."""
    import dataclasses

    from magicpig_jax.io.loader import LoadedModel
    from tests._tiny import TINY, tiny_model

    base = char_model()
    for layers, ok in (((0,), True), (None, False)):
        m = tiny_model(0, dataclasses.replace(TINY, sliding_window=64, sliding_layers=layers))
        model = LoadedModel(m.module, m.config, base.tokenizer, m.source)
        run = lambda model=model: cal.calibrate(model, TEXT, kl_budget=0.05, length=600, forced_tokens=12,  # noqa: E731
                                                candidates=((4, 8),), num_local=16, probes=2, repeats=1,
                                                max_evals=2, cost="bytes", progress=False)
        if not ok:
            with pytest.raises(ValueError, match="every layer of this model attends through a sliding window of 64"):
                run()
            continue
        lc, report = run()
        assert lc.config(0) == "dense" and set(report["per_layer"][0]["ms"]) == {"dense"}
        assert set(report["per_layer"][1]["ms"]) == {"dense", "4x8"}


def test_file_and_eval_check(calibrated, tmp_path):
    from magicpig_jax.eval.methods import parse_methods
    from magicpig_jax.eval.run import EvalSettings

    model, lc, report = calibrated
    text_file = tmp_path / "cal.txt"
    text_file.write_text(TEXT.replace(". ", ".\n\n"))
    report = dict(report, calibration=dict(report["calibration"], paragraph_sha1=cal.paragraph_hashes(str(text_file))))
    path = lc.save(tmp_path / "cfg.json", extra=report)
    assert LayerConfigs.load(path) == lc and json.loads(path.read_text())["measured_kl"] == report["measured_kl"]
    settings = EvalSettings(tasks=[], lengths=[600], samples=1, methods=parse_methods("dense"), num_local=16,
                            haystack=str(text_file))
    with pytest.raises(ValueError, match="shares"):
        cal.check_config_for_eval(path, model, settings)
    other = tmp_path / "other.txt"
    other.write_text("An entirely different text about hash tables, buckets and the angles between vectors.\n")
    cal.check_config_for_eval(path, model, EvalSettings(**{**settings.__dict__, "haystack": str(other)}))
    with pytest.raises(ValueError, match="num_local"):
        cal.check_config_for_eval(path, model, EvalSettings(**{**settings.__dict__, "haystack": str(other),
                                                               "num_local": 64}))
    # a malformed calibration record names the file and the field (it crashed with AttributeError)
    for field, bad, want in (("calibration", "oops", "'calibration' must be an object"),
                             ("calibration", {"paragraph_sha1": 5}, "'calibration.paragraph_sha1' must be a list"),
                             ("calibration", {"paragraph_sha1": [[1]]}, "'calibration.paragraph_sha1' must be a list")):
        broken = tmp_path / "broken.json"
        broken.write_text(json.dumps(dict(json.loads(path.read_text()), **{field: bad})))
        with pytest.raises(ValueError, match=f"^{re.escape(str(broken))}: {re.escape(want)}"):
            cal.check_config_for_eval(broken, model, EvalSettings(**{**settings.__dict__, "haystack": str(other)}))
    # a file calibrated for a model of other sizes (its layer count equal) is named, not applied
    shape = dict(model.config.model_shape(), hidden_size=model.config.hidden_size + 1)
    foreign = dataclasses.replace(lc, model_shape=shape).save(tmp_path / "foreign.json", extra=report)
    with pytest.raises(ValueError, match=f"^{re.escape(str(foreign))}: the layer configs were calibrated for a model "
                                         "of other sizes: hidden_size"):
        cal.check_config_for_eval(foreign, model, EvalSettings(**{**settings.__dict__, "haystack": str(other)}))


def test_the_python_api_records_the_models_sizes_and_the_texts_paragraphs(calibrated, tmp_path):
    """Only the command line recorded them: a file from calibrate() was applied to a model of other
    sizes, and evaluated on a haystack holding its calibration text, without a word."""
    from magicpig_jax.eval.methods import parse_methods
    from magicpig_jax.eval.run import EvalSettings

    model, lc, report = calibrated
    path = lc.save(tmp_path / "api.json", extra=report)
    assert dict(LayerConfigs.load(path).model_shape) == dict(model.config.model_shape())
    assert report["search_complete"] is True  # max_evals=4 was enough for the fixture's assignments
    same = tmp_path / "same.txt"
    same.write_text(TEXT + "\n")
    settings = EvalSettings(tasks=[], lengths=[600], samples=1, methods=parse_methods("dense"), num_local=16,
                            haystack=str(same))
    with pytest.raises(ValueError, match="shares 1 paragraph"):
        cal.check_config_for_eval(path, model, settings)
    # the same words reflowed (one per line, so one paragraph of another hash): they passed the check
    words = TEXT.split()
    n = (cal.SHARED_RUNS + 1) * cal.SHINGLE_WORDS  # holds SHARED_RUNS whole runs of the text wherever it starts
    reflowed = tmp_path / "reflowed.txt"
    reflowed.write_text("Preamble words that the calibration text does not hold at all.\n\n"
                        + "\n".join(words[5:5 + n]) + "\n")
    assert not set(report["calibration"]["paragraph_sha1"]) & set(cal.paragraph_hashes(str(reflowed)))
    with pytest.raises(ValueError, match=f"shares a passage of [0-9]+ words \\([0-9]+ consecutive runs of "
                                         f"{cal.SHINGLE_WORDS}\\) with the evaluation haystack .* "
                                         "\\(reflowed or not\\)"):
        cal.check_config_for_eval(path, model, dataclasses.replace(settings, haystack=str(reflowed)))
    # shared stretches shorter than the passage (boilerplate of related texts, as the bundled LGPL-2.1
    # shares with the default haystack's GPL) do not refuse the file: each of these holds 6 runs of it
    pieces = [" ".join(words[i:i + 6 * cal.SHINGLE_WORDS]) for i in range(0, len(words) - 72, 120)]
    boiler = tmp_path / "boilerplate.txt"
    boiler.write_text("\n\n".join(f"Other words entirely, number {j}. {p} And more of them." for j, p in
                                   enumerate(pieces)) + "\n")
    cal.check_config_for_eval(path, model, dataclasses.replace(settings, haystack=str(boiler)))


def test_a_calibration_text_named_like_a_haystack_is_read_as_the_file(tmp_path, monkeypatch):
    """--text licenses (a file in the working directory) recorded the paragraphs of every system license."""
    import hashlib

    from magicpig_jax.eval.corpus import text_paragraphs

    monkeypatch.chdir(tmp_path)
    (tmp_path / "licenses").write_text(TEXT.replace(". ", ".\n\n"))
    want = [hashlib.sha1(p.encode()).hexdigest()[:12] for p in text_paragraphs((tmp_path / "licenses").read_text())]
    assert cal.paragraph_hashes("licenses") == want and len(want) == 40


def test_a_search_cut_short_by_max_evals_says_so(capsys):
    model = char_model()
    lc, report = cal.calibrate(model, TEXT, kl_budget=0.05, length=600, forced_tokens=12, candidates=((4, 8), (6, 16)),
                               num_local=16, probes=2, repeats=1, max_evals=1, cost="bytes", progress=False)
    err = capsys.readouterr().err
    # 6 assignments, one measured: the fixture's run (max_evals=4) found a sparse one under this budget
    assert report["assignments"] == 6 and len(report["tried"]) == 2 and report["search_complete"] is False
    assert "--max-evals 1 ran out before the search converged" in err
    assert not lc.sparse_layers and "no measured assignment with a sparse layer met the KL budget 0.05" in err
    cal.calibrate(model, TEXT, kl_budget=1e-9, length=600, forced_tokens=12, candidates=((4, 8), (6, 16)),
                  num_local=16, probes=2, repeats=1, max_evals=8, cost="bytes", progress=False)
    err = capsys.readouterr().err  # a budget no sparse layer meets, the search complete: only that note
    assert "ran out" not in err and "no measured assignment with a sparse layer met the KL budget 1e-09" in err


def test_command_line_is_wired(tmp_path, capsys, monkeypatch):
    assert cli.main(["calibrate", "--kl-budget", "0.1", "--out", str(tmp_path / "x.json"),
                     "--candidates", "10xz"]) == 2
    assert "candidates" in capsys.readouterr().err
    assert cli.main(["calibrate", "--kl-budget", "-1", "--out", str(tmp_path / "x.json")]) == 2
    capsys.readouterr()
    assert cli.main(["calibrate", "--kl-budget", "0.1", "--out", str(tmp_path / "x.json"),
                     "--candidates", "10x150,6x5000"]) == 2  # it was refused only after the load and prefill
    assert capsys.readouterr().err == ("magicpig-jax: error: calibrate: --candidates 6x5000: L must be in [2, 4096] "
                                       "(the host index)\n")
    for extra, message in ((["--forced-tokens", "1"], "--forced-tokens must be >= 2: the first forced token"),
                           (["--forced-tokens", "600"], r"--forced-tokens (600) must be at most 511"),
                           (["--length", "9000"], "--length 9000 is past the model's context of 8192 tokens")):
        # refused before the model loads (the heavy part)
        monkeypatch.setattr("magicpig_jax.io.loader.load_model", lambda *a, **k: pytest.fail("the model loaded"))
        assert cli.main(["calibrate", "--kl-budget", "0.1", "--out", str(tmp_path / "x.json"), *extra]) == 2
        assert capsys.readouterr().err.startswith(f"magicpig-jax: error: calibrate: {message}")
    lc = LayerConfigs.uniform(MagicPIGConfig(), 30, [0, 15])
    path = lc.save(tmp_path / "u.json")
    assert cli.main(["generate", "--prompt", "hi", "--magicpig-config", str(path), "--dense-layers", "0"]) == 2
    assert "--dense-layers cannot be combined" in capsys.readouterr().err


def test_timing_rounds_alternate_the_choices_and_keep_the_median(monkeypatch):
    # each round calls every choice once, in an order rotated by one per round, after a cache flush
    calls, clock = [], iter(range(1000))
    monkeypatch.setattr(cal, "FLUSH_BYTES", 1 << 10)
    monkeypatch.setattr(cal.time, "perf_counter", lambda: float(next(clock)))
    # a fake call advances the fake clock by a per-choice amount: a: 1, 2, 3 s over its rounds (median 2)
    extra = {"a": iter([0, 0, 1, 2]), "b": iter([0, 5, 5, 5]), "c": iter([0, 0, 0, 0])}

    def make(label):
        def fn():
            calls.append(label)
            for _ in range(next(extra[label])):
                next(clock)
            return None
        return fn

    ms = cal._time_choices({label: make(label) for label in "abc"}, repeats=3)
    assert calls[:3] == ["a", "b", "c"]  # compile
    assert calls[3:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert ms == {"a": 2000.0, "b": 6000.0, "c": 1000.0}


def _layers(ms_by_label, bytes_by_label):
    n = len(next(iter(ms_by_label.values())))
    return [LayerCosts(ms={k: float(v[i]) for k, v in ms_by_label.items()}, error=dict.fromkeys(ms_by_label, 0.0),
                       fraction={}, bytes={k: float(v[i]) for k, v in bytes_by_label.items()}) for i in range(n)]


def test_pooled_ms_recovers_a_line_and_pools_the_dense_layers():
    import numpy as np

    x = np.array([1e6, 2e6, 3e6, 4e6, 5e6])
    dense_ms = np.array([1.0, 1.1, 0.9, 5.0, 1.05])  # one slow layer of identical work
    layers = _layers({"dense": dense_ms, "10x150": 0.2 + 1e-7 * x, "12x600": 2.0 - 1e-7 * x},
                     {"dense": np.full(5, 8e6), "10x150": x, "12x600": x})
    cal.pool_ms(layers)
    np.testing.assert_allclose([c.ms_fit["10x150"] for c in layers], 0.2 + 1e-7 * x, rtol=1e-12)
    # a cost never falls with the bytes read: the slope is clipped at 0, the intercept is the median
    np.testing.assert_allclose([c.ms_fit["12x600"] for c in layers], np.median(2.0 - 1e-7 * x))
    assert [c.ms_fit["dense"] for c in layers] == [1.05] * 5  # the median over layers, not the slow layer's 5.0
    assert layers[3].cost("dense") == 1.05 and layers[3].cost("dense", "ms-per-layer") == 5.0
    assert layers[3].cost("dense", "bytes") == 8e6
    with pytest.raises(ValueError, match="cost kind must be one of"):
        layers[0].cost("dense", "seconds")


@pytest.mark.parametrize("seed", range(4))
def test_pooled_ms_equals_a_numpy_fit(seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.uniform(1e5, 4e6, 30)
    y = 0.3 + 2e-7 * x + rng.normal(0, 0.2, 30)
    layers = _layers({"c": y}, {"c": x})
    cal.pool_ms(layers)
    slope = max(np.polyfit(x, y, 1)[0], 0.0)  # the float64 least-squares reference
    want = np.median(y - slope * x) + slope * x
    np.testing.assert_allclose([c.ms_fit["c"] for c in layers], want, rtol=1e-9)
    assert layers[0].cost("c") == layers[0].ms_fit["c"] != layers[0].ms["c"]


@pytest.mark.parametrize("seed", range(3))
def test_default_sweep_reaches_every_assignment_of_a_fine_grid(seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = ["dense", "9x60", "10x150", "11x300", "12x600"]
    layers = [LayerCosts(ms=dict(zip(labels, rng.uniform(0.5, 1.5, 5), strict=True)),
                         error={"dense": 0.0, **dict(zip(labels[1:], rng.uniform(1e-3, 0.3, 4), strict=True))},
                         fraction={}) for _ in range(12)]
    fine = assignments(layers, lambdas=list(10.0 ** np.arange(-3, 5, 0.0005)))
    default = assignments(layers)
    assert set(fine) <= set(default)
    costs = [cal.total_cost(layers, a) for a in default]
    assert costs == sorted(costs) and default[-1] == ("dense",) * 12


def test_a_file_calibrated_on_another_model_of_the_same_sizes_is_noted(calibrated, tmp_path, capsys, monkeypatch):
    """The llama3 and qwen2 fixtures have the same sizes, so the sizes check accepts either's file for the
    other: calibrate records the model's weights identity, and eval and generate note a file measured on
    another model; the same model converted to a checkpoint, or a GGUF under another name, is not another."""
    from magicpig_jax import load_model
    from magicpig_jax.eval.methods import parse_methods
    from magicpig_jax.eval.run import EvalSettings
    from magicpig_jax.io.digest import weights_identity
    from magicpig_jax.io.loader import convert_model

    families = Path(__file__).parent / "fixtures" / "families"
    llama3, qwen2 = families / "llama3", families / "qwen2"
    _, _, report = calibrated
    record = report["calibration"]
    assert record["weights_id"] is None and record["source_weights_id"] is None  # a model held in memory
    assert cal._identities(llama3) == (weights_identity(llama3), None)
    assert weights_identity(llama3) != weights_identity(qwen2)
    model = load_model(qwen2)
    shape = model.config.model_shape()
    assert load_model(llama3).config.model_shape() == shape
    lc = LayerConfigs(layers=((0, "dense"), (1, MagicPIGConfig(K=4, L=8))), model_shape=shape)
    path = lc.save(tmp_path / "cfg.json", extra={"calibration": {"weights_id": weights_identity(llama3),
                                                                 "paragraph_sha1": []}})
    note = cal.other_model_note(path, qwen2)
    assert note == (f"{path} was calibrated on another model (weights {weights_identity(llama3)}; this model's are "
                    f"{weights_identity(qwen2)}): its layers are applied as written, but the KL budget it met was "
                    "measured on that model")
    assert cal.other_model_note(path, llama3) is None
    # a copy whose metadata changed (no generation_config.json, another chat template): the same weights
    import shutil

    edited = shutil.copytree(llama3, tmp_path / "llama3_edited")
    (edited / "generation_config.json").unlink(missing_ok=True)
    (edited / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert weights_identity(edited) == weights_identity(llama3) and cal.other_model_note(path, edited) is None
    # the same model converted, either way round: its checkpoint records the source's identity
    converted = convert_model(llama3, tmp_path / "llama3_ckpt")
    assert cal._identities(converted)[1] == weights_identity(llama3) != weights_identity(converted)
    assert cal.other_model_note(path, converted) is None
    from_ckpt = lc.save(tmp_path / "from_ckpt.json", extra={"calibration": dict(
        zip(("weights_id", "source_weights_id"), cal._identities(converted), strict=True))})
    assert cal.other_model_note(from_ckpt, llama3) is None and cal.other_model_note(from_ckpt, qwen2) is not None
    other = tmp_path / "other.txt"
    other.write_text("An entirely different text about hash tables, buckets and the angles between vectors.\n")
    settings = EvalSettings(tasks=[], lengths=[600], samples=1, methods=parse_methods("dense"), haystack=str(other))
    capsys.readouterr()
    cal.check_config_for_eval(path, model, settings)  # noted, not refused
    assert capsys.readouterr().err == f"magicpig-jax: note: eval: {note}\n"
    unrecorded = lc.save(tmp_path / "hand.json", extra={"calibration": {"paragraph_sha1": []}})
    assert cal.other_model_note(unrecorded, qwen2) is None  # written by hand: nothing to compare
    bad = lc.save(tmp_path / "bad.json", extra={"calibration": {"weights_id": 5}})
    with pytest.raises(ValueError, match=r"'calibration.weights_id' must be a string"):
        cal.other_model_note(bad, qwen2)
    # refused before the model loads (generate had printed 'model: ... loaded' first), and by eval's parser
    monkeypatch.setattr("magicpig_jax.io.loader.load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert cli.main(["generate", "--prompt", "hi", "--magicpig-config", str(bad)]) == 2
    assert "'calibration.weights_id' must be a string" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"'calibration.weights_id' must be a string"):
        parse_methods(f"magicpig@{bad}")


def test_a_gguf_keeps_its_weights_identity_under_another_name(tmp_path):
    """A symlink or a renamed copy of a GGUF names the same weights (eval's model_sha1, which hashes the
    file's name, differs): a file calibrated on it draws no note."""
    from magicpig_jax.io.digest import weights_identity
    from magicpig_jax.io.embedded import embedded_model_path

    gguf = Path(embedded_model_path())
    link = tmp_path / "renamed.gguf"
    link.symlink_to(gguf)
    assert weights_identity(link) == weights_identity(gguf)
    lc = LayerConfigs.load("examples/results/calibrated_smollm2.json")
    path = lc.save(tmp_path / "cfg.json", extra={"calibration": {"weights_id": weights_identity(gguf)}})
    assert cal.other_model_note(path, link) is None
