"""magicpig_jax.eval.study: the cost-model helpers and one tiny end-to-end run (JSON only)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats

from magicpig_jax.eval import study


def u64(cos, K, L):
    p = 1 - np.arccos(np.clip(cos, -1, 1)) / np.pi
    return stats.binom.sf(1, L, p**K)


def test_expected_sampled_fraction_matches_float64():
    cos = np.random.default_rng(0).normal(0, 0.3, 500).clip(-1, 1)
    for K, L in [(10, 150), (8, 60), (11, 300)]:
        assert study.expected_sampled_fraction(cos, K, L) == pytest.approx(float(np.mean(u64(cos, K, L))), rel=1e-4)


def test_tables_for_fraction_is_the_smallest_l():
    cos = np.random.default_rng(1).normal(0, 0.1, 1000).clip(-1, 1)
    L = study.tables_for_fraction(cos, 10, 0.02)
    assert np.mean(u64(cos, 10, L)) >= 0.02 * (1 - 1e-4)
    assert np.mean(u64(cos, 10, L - 1)) < 0.02 * (1 + 1e-4)
    assert study.tables_for_fraction(np.ones(3), 10, 0.5) == 2  # p = 1: always sampled


@pytest.mark.parametrize("target", [0.0, 1.0, -0.1, 2])
def test_tables_for_fraction_bad_target(target):
    with pytest.raises(ValueError, match="target"):
        study.tables_for_fraction(np.zeros(4), 10, target)


def test_tables_for_fraction_unreachable():
    with pytest.raises(ValueError, match="not reached"):
        study.tables_for_fraction(-np.ones(4), 10, 0.5, max_L=64)  # p = 0: never sampled


def test_expected_sampled_fraction_bad_input():
    with pytest.raises(ValueError, match="empty"):
        study.expected_sampled_fraction(np.zeros(0), 10, 150)
    with pytest.raises(ValueError, match="K"):
        study.expected_sampled_fraction(np.zeros(3), 0, 150)


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


def test_main_end_to_end_on_a_capture(tmp_path):
    rng = np.random.default_rng(3)
    cap = tmp_path / "cap.npz"
    np.savez(cap, q=rng.normal(size=(2, 4, 16)), k=rng.normal(size=(2, 2, 100, 16)), v=rng.normal(size=(2, 2, 100, 16)))
    out = tmp_path / "out"
    argv = ["--capture", str(cap), "--no-synthetic", "--fractions", "1.0", "--lsh", "4x10",
            "--repeats", "1", "--num-local", "8", "--out", str(out), "--layers", "1"]
    assert study.main(argv) == 0
    png = (out / "study.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    result = json.loads((out / "study.json").read_text())
    recs = {(r["method"], json.dumps(r["params"], sort_keys=True)): r for r in result["records"]}
    assert {r["case"] for r in result["records"]} == {"layer1"}
    assert len(recs) == 5  # topk, quest, oracle, magicpig centered / uncentered
    for r in result["records"]:
        assert np.isfinite(r["rel_error"]) and 0 < r["fraction"] <= 1
        if r["method"] in ("topk", "quest"):  # the whole context: exact
            assert r["fraction"] == 1.0 and r["rel_error"] < 1e-5
        if r["method"] == "oracle":
            assert r["rel_error"] > 1e-3  # 100 draws with replacement are not exact
        if r["method"] == "magicpig":
            assert 12 / 100 <= r["fraction"] <= 1 and 0 <= r["predicted_fraction"] <= 1
    assert {s["method"] for s in result["summary"]} == {"topk", "quest", "oracle", "magicpig"}


def test_main_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError):
        study.main(["--capture", str(tmp_path / "missing.npz"), "--no-plot"])
    bad = tmp_path / "bad.npz"
    np.savez(bad, q=np.zeros((2, 4, 16)), k=np.zeros((2, 2, 10, 8)), v=np.zeros((2, 2, 10, 8)))
    with pytest.raises(ValueError, match="capture"):
        study.main(["--capture", str(bad), "--no-synthetic", "--no-plot"])
    with pytest.raises(ValueError, match="nothing to study"):
        study.main(["--no-synthetic", "--no-plot"])
    with pytest.raises(ValueError, match="profiles"):
        study.main(["--profiles", "nope", "--no-plot"])
    with pytest.raises(SystemExit):
        study.main(["--lsh", "10-150"])
