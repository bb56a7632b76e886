"""magicpig_jax.eval.study (and study_measure, study_plot): synthetic cases and tiny end-to-end runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from magicpig_jax import attention
from magicpig_jax.eval import study


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
