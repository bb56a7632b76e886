"""magicpig_jax.eval.likelihood: the likelihood metrics against their definitions, and the prose samples."""

from __future__ import annotations

import numpy as np
import pytest

from magicpig_jax.eval.likelihood import compare_to_dense, log_softmax, make_likelihood_sample

HAY = "licenses"


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
