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


def test_likelihood_samples_of_a_length_are_distinct_documents():
    # each sample drew its start on its own: at 2K with seed 0, samples 0 and 1 of the default haystack
    # were the same text (zero-width intervals over "independent" documents)
    from magicpig_jax.eval.corpus import load_prose
    from magicpig_jax.eval.likelihood import likelihood_start
    from magicpig_jax.eval.settings import DEFAULT_HAYSTACK

    P = len(load_prose(DEFAULT_HAYSTACK))
    for length in (2048, 4096, 8192):
        for seed in (0, 1):
            starts = [likelihood_start(P, length, i, seed) for i in range(P)]
            assert sorted(starts) == list(range(P)), (length, seed)  # every paragraph once
    assert likelihood_start(P, 2048, P, 0) == likelihood_start(P, 2048, 0, 0)  # then it wraps
    encode = lambda x: [ord(c) % 97 for c in x]  # noqa: E731
    docs = [make_likelihood_sample(encode, 2048, i, haystack=DEFAULT_HAYSTACK, forced=16) for i in range(16)]
    assert len({d.paragraph for d in docs}) == 16 and len({d.ids for d in docs}) == 16
    with pytest.raises(ValueError, match="num_paragraphs"):
        likelihood_start(0, 2048, 0)


def test_ruled_out_tokens_nan_and_bad_targets():
    """Dense compared with itself gave KL NaN when both rule a token out (0 * (-inf - -inf)); a NaN
    row still gave a finite top-1; a target of -1 read the last token's probability. A reviewer's
    findings; the float64 reference takes 0 log 0 = 0."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, 9))
    logits[:, 3] = -np.inf  # a token both rule out
    ld = log_softmax(logits)
    m = compare_to_dense(ld, ld, [0, 1, 2, 4])
    assert m["kl"] == 0.0 and m["kl_max"] == 0.0 and m["top1"] == 1.0
    other = log_softmax(logits + rng.normal(size=logits.shape))
    p = np.exp(ld[:, [0, 1, 2, 4, 5, 6, 7, 8]])
    want = (p * (ld - other)[:, [0, 1, 2, 4, 5, 6, 7, 8]]).sum(-1)
    got = compare_to_dense(other, ld, [0, 1, 2, 4])
    assert got["kl"] == pytest.approx(want.mean(), rel=1e-12) and got["kl_max"] == pytest.approx(want.max())
    ruled_out = other.copy()
    ruled_out[1, 0] = -np.inf  # the method rules out a token dense does not: infinitely far
    assert compare_to_dense(ruled_out, ld, [0, 1, 2, 4])["kl_max"] == np.inf
    tiny = ld.copy()
    tiny[1, 0] = -800.0  # dense's probability underflows to 0, the method rules the token out: inf, not NaN
    assert compare_to_dense(ruled_out, tiny, [0, 1, 2, 4])["kl_max"] == np.inf
    nan = other.copy()
    nan[2, 5] = np.nan
    with pytest.raises(ValueError, match="logp holds NaN at row 2"):
        compare_to_dense(nan, ld, [0, 1, 2, 4])
    with pytest.raises(ValueError, match="logp_dense holds NaN at row 2"):
        compare_to_dense(ld, nan, [0, 1, 2, 4])
    for bad in ([0, 1, 2, -1], [0, 1, 2, 9], [0.0, 1.0, 2.0, 4.0]):
        with pytest.raises(ValueError, match=r"targets must be integer token ids in \[0, 9\)"):
            compare_to_dense(other, ld, bad)
    with pytest.raises(ValueError, match="with n >= 1"):
        compare_to_dense(ld[:0], ld[:0], [])
    with pytest.raises(ValueError, match="must be an int"):
        make_likelihood_sample(lambda x: [ord(c) % 97 for c in x], 500, 0, haystack=HAY, forced=2.5)
