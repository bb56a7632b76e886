"""magicpig_jax.eval.corpus: the prose and word sources of the generators."""

from __future__ import annotations

import pytest

from magicpig_jax.eval import corpus

HAY = "licenses"


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


def test_heldout_licenses_exclude_the_calibration_text():
    # the default haystack of `magicpig-jax eval` holds no paragraph of calibrate's default text, so
    # the committed calibrated file passes eval's overlap check on it, and not on all the licenses
    import types
    from pathlib import Path

    from magicpig_jax.eval.calibrate import DEFAULT_TEXT, check_config_for_eval
    from magicpig_jax.eval.settings import EvalSettings

    assert EvalSettings.__dataclass_fields__["haystack"].default == corpus.DEFAULT_HAYSTACK == "licenses-heldout"
    assert DEFAULT_TEXT == corpus.CALIBRATION_TEXT
    held, every = corpus.load_prose("licenses-heldout"), corpus.load_prose("licenses")
    calibration = set(corpus._paragraphs([DEFAULT_TEXT.read_text()]))
    assert len(held) > 300 and not calibration & set(held)
    assert calibration & set(every) and set(held) < set(every)
    # the LGPL-2 files are left out (LGPL-2 is a near copy of LGPL-2.1): what remains of their
    # paragraphs is text other licenses repeat word for word
    files = {p.resolve() for p in corpus.LICENSES_DIR.iterdir() if p.resolve().is_file()}
    lgpl2 = set(corpus._paragraphs([p.read_text() for p in files if p.name.startswith("LGPL-2")]))
    others = set(corpus._paragraphs([p.read_text() for p in files if not p.name.startswith("LGPL-2")]))
    assert lgpl2 - others and not (lgpl2 - others) & set(held)
    cfg = Path(__file__).resolve().parent.parent / "examples" / "results" / "calibrated_smollm2.json"
    shape = {"num_layers": 30, "hidden_size": 576, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64,
             "vocab_size": 49152}  # SmolLM2-135M's, for which the committed file was calibrated
    model = types.SimpleNamespace(config=types.SimpleNamespace(num_layers=30, model_shape=lambda: shape))
    check_config_for_eval(cfg, model, types.SimpleNamespace(haystack="licenses-heldout", num_sink=4, num_local=64))
    with pytest.raises(ValueError, match="shares .* paragraph"):
        check_config_for_eval(cfg, model, types.SimpleNamespace(haystack="licenses", num_sink=4, num_local=64))
