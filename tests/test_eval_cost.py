"""magicpig_jax.eval.cost: ms per step from the decode stats and the bytes a step's attention reads,
against the formulas written out per method."""

from __future__ import annotations

import math

import pytest

from magicpig_jax.eval.cost import ms_per_step, step_bytes

SHAPE = dict(num_layers=4, num_heads=6, num_kv_heads=2, head_dim=8)


def _bytes(backend, frac=0.1, **kw):
    args = dict(SHAPE, context=1000.0, dense_layers=[0], fraction_per_layer={"1": frac, "2": frac, "3": frac},
                num_sink=4, num_local=60, K=4, L=20)
    args.update(kw)
    return step_bytes(backend, **args)


def test_ms_per_step():
    assert ms_per_step({"decode_steps": 11, "decode_seconds": 0.5}) == pytest.approx(50.0)
    assert ms_per_step({"decode_steps": 1, "decode_seconds": 0.0}) is None


def test_dense_reads_every_key():
    b = _bytes("dense")
    assert b["k"] == b["v"] == 4 * 1000 * 2 * 8 * 4 and b["index"] == b["pages"] == 0
    assert b["total"] == b["k"] + b["v"]
    assert _bytes("dense", kv_bytes=2)["total"] == b["total"] / 2


def test_each_method_by_its_formula():
    n, s, e, D, Hkv, Hq = 1000.0, 64.0, 4, 8, 2, 6
    m = n - s
    dense_layer = n * Hkv * D * e
    static = s * Hkv * D * e
    used = 0.1 * n * Hq
    mp = _bytes("magicpig")
    assert mp["k"] == pytest.approx(dense_layer + 3 * (static + used * D * e))
    assert mp["index"] == pytest.approx(3 * Hq * 20 * (4 + 2 * m / 16))
    tk = _bytes("topk")
    assert tk["k"] == pytest.approx(dense_layer + 3 * (static + m * Hkv * D * e))
    assert tk["v"] == pytest.approx(dense_layer + 3 * (static + used * D * e))
    qu = _bytes("quest", page_size=16)
    assert qu["pages"] == pytest.approx(3 * 2 * math.ceil(m / 16) * Hkv * D * 4)
    assert _bytes("hybrid") == mp and _bytes("oracle")["k"] == tk["k"]
    per_layer = _bytes("magicpig", layer_kl={1: (4, 20), 2: (8, 100), 3: (4, 20)})
    assert per_layer["index"] == pytest.approx(2 * Hq * 20 * (4 + 2 * m / 16) + Hq * 100 * (4 + 2 * m / 256))
    with pytest.raises(ValueError):
        _bytes("flash")
    with pytest.raises(ValueError, match="K and L"):
        _bytes("magicpig", K=None, L=None)
