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
    for bad in ("flash", "magicpig:10", "topk:0", "dense,dense", "magicpig:40x10"):
        with pytest.raises(ValueError):
            parse_methods(bad)
    assert parse_lengths("2K,4k,8192") == [2048, 4096, 8192]
    with pytest.raises(ValueError):
        parse_lengths("2Q")
