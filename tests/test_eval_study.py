"""magicpig_jax.eval.study (and study_measure, study_plot): synthetic cases and tiny end-to-end runs."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from magicpig_jax import attention, lsh
from magicpig_jax.eval import study
from tests import _np_reference as np_ref


def test_cost_model_is_re_exported_from_the_method_layer():
    assert study.expected_sampled_fraction is attention.expected_sampled_fraction
    assert study.tables_for_fraction is attention.tables_for_fraction


def test_synthetic_case_realizes_the_profile():
    rng = np.random.default_rng(2)
    q, k, v = study.synthetic_case(rng, "zipf", n=256, d=16, heads=2)
    assert q.shape == (1, 2, 16) and k.shape == v.shape == (1, 2, 256, 16)
    logits = np.einsum("hd,hnd->hn", q[0].astype(np.float64), k[0].astype(np.float64)) / 4.0
    t = np.sort(logits[0, 4:])[::-1]  # Zipf: t_rank = -0.9 log(rank) + const
    np.testing.assert_allclose(t[:50] - t[0], -0.9 * np.log(np.arange(1, 51)), atol=1e-3)
    assert np.all(logits[:, :4] > logits[:, 4:].max(-1, keepdims=True))  # sinks on top
    with pytest.raises(ValueError, match="profile"):
        study.synthetic_case(rng, "nope")


def _np_codes(x: np.ndarray, w: np.ndarray, K: int, L: int) -> np.ndarray:
    """Float64 SimHash codes: bit j of table l is [x · w[:, l*K + j] > 0]."""
    bits = ((x @ w) > 0).reshape(*x.shape[:-1], L, K).astype(np.int64)
    return np.sum(bits << np.arange(K), axis=-1)


def _magicpig_reference(q, k, v, seed, repeat, K, L, num_sink, num_local, center):
    """(rel_error, fraction, predicted_fraction) of one MagicPIG record, in float64 (tests/_np_reference).

    Same projections as the study (key ``seed * 1000 + r``); codes, estimator, dense attention and
    the cost model's prediction (SciPy's binomial tail at the centered cosines) computed here."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))  # [1, Hq, D], [1, Hkv, N, D]
    _, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    start, end = min(num_sink, N), max(N - num_local, min(num_sink, N))
    mean = k[:, :, start:end].mean(2, keepdims=True) if center else np.zeros((1, Hkv, 1, D))
    o, _ = np_ref.dense(q, k, v)
    errs, fracs = [], []
    for r in range(repeat):
        w = np.asarray(lsh.simhash_projections(jax.random.key(seed * 1000 + r), D, K, L), np.float64)
        out, _, num = np_ref.magicpig(q, k, v, _np_codes(k - mean, w, K, L), _np_codes(q, w, K, L), K, L,
                                      num_sink, num_local, [N], [N], center=center)
        errs.append(np.linalg.norm(out - o, axis=-1)[0] / np.linalg.norm(o, axis=-1)[0])
        fracs.append((num[0] + start + N - end) / N)
    kc = (k - mean)[0]  # [Hkv, N, D]
    cos = np.stack([kc[h // (Hq // Hkv)] @ q[0, h] / (np.linalg.norm(kc[h // (Hq // Hkv)], axis=-1)
                                                      * np.linalg.norm(q[0, h])) for h in range(Hq)])
    p = 1 - np.arccos(np.clip(cos[:, start:end], -1, 1)) / np.pi
    pred = (np_ref.u_exact(p, K, L).sum(-1) + start + N - end) / N
    return float(np.mean(errs)), float(np.mean(fracs)), float(np.mean(pred))


def test_main_end_to_end_on_a_capture(tmp_path):
    rng = np.random.default_rng(3)
    cap = tmp_path / "cap.npz"
    # keys in a cone (a common offset per KV head, as in real models): centering matters
    k = rng.normal(size=(2, 2, 100, 16)) + 3.0 * rng.normal(size=(2, 2, 1, 16))
    v = rng.normal(size=(2, 2, 1, 16)) + rng.normal(size=(2, 2, 100, 16))  # values share a mean: |o| ~ 1
    np.savez(cap, q=rng.normal(size=(2, 4, 16)), k=k, v=v)
    out = tmp_path / "out"
    argv = ["--capture", str(cap), "--no-synthetic", "--fractions", "1.0", "--lsh", "4x10",
            "--repeats", "2", "--num-local", "8", "--out", str(out), "--layers", "1", "--seed", "5"]
    assert study.main(argv) == 0
    png = (out / "study.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    result = json.loads((out / "study.json").read_text())
    recs = {(r["method"], json.dumps(r["params"], sort_keys=True)): r for r in result["records"]}
    assert {r["case"] for r in result["records"]} == {"layer1"}
    assert len(recs) == 7  # topk, quest, oracle, magicpig centered / uncentered, hybrid heavy 4 / 8
    for r in result["records"]:
        assert np.isfinite(r["rel_error"]) and 0 < r["fraction"] <= 1
        if r["method"] in ("topk", "quest"):  # the whole context: exact
            assert r["fraction"] == 1.0 and r["rel_error"] < 1e-5
        if r["method"] == "oracle":
            assert r["rel_error"] > 1e-3  # 100 draws with replacement are not exact
    # MagicPIG, centered and uncentered: error, touched fraction and the cost model's prediction
    # equal a float64 recomputation (layer 1 of the capture, the study's projections).
    data = np.load(cap)
    magic = {r["params"]["center"]: r for r in result["records"] if r["method"] == "magicpig"}
    assert set(magic) == {True, False}
    want = {}
    for center, r in magic.items():
        assert r["params"] == {"K": 4, "L": 10, "center": center, "num_sink": 4, "num_local": 8}
        err, frac, pred = _magicpig_reference(data["q"][1:2], data["k"][1:2], data["v"][1:2], 5, 2, 4, 10, 4, 8,
                                              center)
        want[center] = err
        assert r["rel_error"] == pytest.approx(err, rel=1e-4), center
        assert r["fraction"] == pytest.approx(frac, abs=1e-12), center
        assert r["predicted_fraction"] == pytest.approx(pred, abs=1e-5), center
        assert 12 / 100 < r["fraction"] < 1
    # centering the cone's keys lowers the error (by the recomputed amount)
    assert want[True] < 0.5 * want[False]
    assert magic[False]["rel_error"] - magic[True]["rel_error"] == pytest.approx(want[False] - want[True], rel=1e-3)
    # the hybrid: MagicPIG's sampled set (same projections), its own weights, error as a float64 recomputation
    from tests.test_attention_hybrid import hybrid_ref

    q1, k1, v1 = data["q"][1:2], data["k"][1:2], data["v"][1:2]
    o, _ = np_ref.dense(q1, k1, v1)
    for r in (r for r in result["records"] if r["method"] == "hybrid"):
        assert r["fraction"] == pytest.approx(magic[True]["fraction"], abs=1e-12)
        errs = []
        for rep in range(2):
            w = lsh.simhash_projections(jax.random.key(5 * 1000 + rep), 16, 4, 10)
            out, _, _ = hybrid_ref(q1, k1, v1, w, 4, 10, r["params"]["heavy"], 4, 8)
            errs.append(np.linalg.norm(out - o, axis=-1)[0] / np.linalg.norm(o, axis=-1)[0])
        assert r["rel_error"] == pytest.approx(float(np.mean(errs)), rel=1e-3)
    assert {s["method"] for s in result["summary"]} == {"topk", "quest", "oracle", "magicpig", "hybrid"}


def test_main_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError):
        study.main(["--capture", str(tmp_path / "missing.npz"), "--no-plot"])
    bad = tmp_path / "bad.npz"
    np.savez(bad, q=np.zeros((2, 4, 16)), k=np.zeros((2, 2, 10, 8)), v=np.zeros((2, 2, 10, 8)))
    with pytest.raises(ValueError, match="capture"):
        study.main(["--capture", str(bad), "--no-synthetic", "--no-plot"])
    with pytest.raises(ValueError, match="nothing to study"):
        study.main(["--no-synthetic", "--no-plot"])
    # a non-finite value in a capture is refused (it would write NaN errors into study.json)
    for name in ("k", "v"):
        arrays = {"q": np.ones((1, 4, 8)), "k": np.ones((1, 2, 300, 8)), "v": np.ones((1, 2, 300, 8))}
        arrays[name][0, 0, 100, 3] = np.nan if name == "k" else np.inf
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        with pytest.raises(ValueError, match=f"array {name} holds 1 NaN or infinite values"):
            study.main(["--capture", str(path), "--no-synthetic", "--no-plot", "--out", str(tmp_path / "o")])
    with pytest.raises(ValueError, match="profiles"):
        study.main(["--profiles", "nope", "--no-plot"])
    with pytest.raises(SystemExit):
        study.main(["--lsh", "10-150"])


def test_baseline_budgets_are_the_baselines_own_and_the_json_records_the_run(tmp_path):
    """0.07 x 100 is 7.000000000000001 in float64: ceil gave TopK and oracle 8 keys in the record
    while topk_attention(0.07) keeps 7. The JSON lacked the synthetic sizes and the source revision."""
    import json

    out = tmp_path / "st"
    study.main(["--n", "100", "--heads", "1", "--head-dim", "8", "--lsh", "4x4", "--heavy", "", "--repeats", "1",
                "--fractions", "0.07", "--profiles", "gauss1", "--num-local", "8", "--no-plot", "--out", str(out)])
    data = json.loads((out / "study.json").read_text())
    topk = [r for r in data["records"] if r["method"] == "topk"]
    oracle = [r for r in data["records"] if r["method"] == "oracle"]
    assert topk and all(r["fraction"] == 0.07 for r in topk), topk[0]  # 7 of 100 keys
    assert all(r["params"]["draws"] == 7 for r in oracle)
    assert data["settings"]["synthetic"] == {"n": 100, "head_dim": 8, "heads": 1, "profiles": ["gauss1"]}
    assert set(data["meta"]) >= {"source", "cpu", "jax", "jaxlib"}
