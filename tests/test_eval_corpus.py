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
