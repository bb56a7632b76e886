"""magicpig_jax.eval.methods: parsing ``--methods`` and ``--lengths``."""

from __future__ import annotations

import pytest

from magicpig_jax.eval.methods import parse_lengths, parse_methods


def test_parse_methods_and_lengths():
    ms = parse_methods("oracle,topk,dense,magicpig:8x75,quest")
    assert [m.label for m in ms] == ["dense", "magicpig:10x150", "magicpig:8x75", "topk", "quest", "oracle"]
    assert [m.label for m in parse_methods("quest:0.05,dense")] == ["dense", "quest:0.05"]  # fixed budget: no ref
    assert parse_methods("magicpig:11x300")[0].K == 11
    assert parse_methods("magicpig-ref:4x8")[0].backend == "magicpig-ref"
    for bad in ("flash", "magicpig:10", "topk:0", "topk:4294967297", "dense,dense", "magicpig:40x10"):
        with pytest.raises(ValueError):
            parse_methods(bad)
    assert parse_lengths("2K,4k,8192") == [2048, 4096, 8192]
    with pytest.raises(ValueError):
        parse_lengths("2Q")


def test_parse_new_methods(tmp_path):
    hy = parse_methods("hybrid:10x150x12")[0]
    assert (hy.label, hy.backend, hy.K, hy.L, hy.heavy) == ("hybrid:10x150x12", "hybrid", 10, 150, 12)
    assert parse_methods("hybrid")[0].label == "hybrid:10x150x8"
    ref = parse_methods("topk-ref:32,quest-ref")
    assert [(m.label, m.backend, m.host) for m in ref] == [("magicpig:10x150", "magicpig", None),
                                                          ("topk-ref:32", "topk", False),
                                                          ("quest-ref", "quest", False)]
    from magicpig_jax.attention import LayerConfigs, MagicPIGConfig

    cfg = LayerConfigs.uniform(MagicPIGConfig(), 3, [0]).save(tmp_path / "cal.json")
    m = parse_methods(f"dense,magicpig@{cfg}")[1]
    assert (m.label, m.backend, m.config_file) == ("magicpig@cal", "magicpig", str(cfg))
    for bad in ("hybrid:10x150x2", "hybrid:10", "hybrid:10x150x151x3"):
        with pytest.raises(ValueError):
            parse_methods(bad)
    with pytest.raises(FileNotFoundError):
        parse_methods(f"magicpig@{tmp_path / 'none.json'}")
    with pytest.raises(ValueError, match="budget-from"):
        parse_methods("topk", budget_from=f"magicpig@{cfg}")


def test_layer_configs_host_limits_follow_the_backend(tmp_path, monkeypatch):
    """A per-layer file with K above the host index's limit is refused where the host ops run (the CPU
    backend) and accepted where per-layer configs run in pure JAX (an accelerator): the one function
    :func:`host_ops_by_default` decides for the eval, the CLI and :class:`DecodeSpec` alike."""
    from magicpig_jax.attention import LayerConfigs, MagicPIGConfig
    from magicpig_jax.host.index import HOST_MAX_K
    from magicpig_jax.models.backends import spec

    big = LayerConfigs.uniform(MagicPIGConfig(K=HOST_MAX_K + 1, L=8), 3, [0]).save(tmp_path / "big.json")
    assert spec.host_ops_by_default()  # the suite runs on the CPU backend
    with pytest.raises(ValueError, match=rf"layer 1: the host index takes K in \[1, {HOST_MAX_K}\]"):
        parse_methods(f"magicpig@{big}")
    monkeypatch.setattr(spec, "host_ops_by_default", lambda: False)
    assert parse_methods(f"magicpig@{big}")[0].config_file == str(big)
    layers = LayerConfigs.load(big)
    layered = spec.DecodeSpec(backend="magicpig", magicpig=layers.base(), dense_layers=layers.dense_layers,
                              layers=layers)
    assert (layered.host, layered.offload) == (False, False)  # pure JAX, as the eval's check assumed


def test_page_size_is_read_by_measured_budgets():
    # it rounds the measured budget of topk / oracle too (run._budget_tokens): accepted without quest
    from magicpig_jax.eval.settings import make_parser, settings_from_args

    for methods in ("dense,topk", "dense,oracle"):
        s = settings_from_args(make_parser().parse_args(["--out", "x", "--methods", methods, "--page-size", "1"]))
        assert s.page_size == 1


def test_one_budget_written_two_ways_is_one_method_and_a_length_twice_is_refused():
    """topk:016 and topk:16 (or :.5 and :0.5) ran as two methods with the same budget, each sample
    decoded twice and the summary showing one method twice; --lengths 2K,2048 ran 2048 twice; a
    non-ASCII digit was read as a number. A reviewer's findings."""
    for text in ("topk:16,topk:016", "topk:0.5,topk:.5", "quest:16,quest: 16"):
        with pytest.raises(ValueError, match="duplicate methods"):
            parse_methods(text)
    # a fraction 1.0 (every key) and one token are two budgets
    assert [m.label for m in parse_methods("topk:016,topk:1.0,topk:1")] == ["topk:16", "topk:1.0", "topk:1"]
    assert parse_methods("topk: 16")[0].label == "topk:16" and parse_methods("oracle:5e-2")[0].label == "oracle:0.05"
    with pytest.raises(ValueError, match="budget must be"):
        parse_methods("topk:\u0663")  # ARABIC-INDIC DIGIT THREE
    with pytest.raises(ValueError, match="2048 tokens twice"):
        parse_lengths("2K,2048")
