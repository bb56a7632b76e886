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
    hyperplanes = 4 * D * 4 * 20  # float32 [D, K L], read to hash the query
    assert mp["index"] == pytest.approx(3 * (Hq * 20 * (4 + 2 * m / 16) + hyperplanes))
    tk = _bytes("topk")
    assert tk["k"] == pytest.approx(dense_layer + 3 * (static + m * Hkv * D * e))
    assert tk["v"] == pytest.approx(dense_layer + 3 * (static + used * D * e))
    qu = _bytes("quest", page_size=16)
    assert qu["pages"] == pytest.approx(3 * 2 * math.ceil(m / 16) * Hkv * D * 4)
    assert _bytes("hybrid") == mp and _bytes("oracle")["k"] == tk["k"]
    per_layer = _bytes("magicpig", layer_kl={1: (4, 20), 2: (8, 100), 3: (4, 20)})
    assert per_layer["index"] == pytest.approx(2 * (Hq * 20 * (4 + 2 * m / 16) + 4 * D * 4 * 20)
                                               + Hq * 100 * (4 + 2 * m / 256) + 4 * D * 8 * 100)
    with pytest.raises(ValueError):
        _bytes("flash")
    with pytest.raises(ValueError, match="K and L"):
        _bytes("magicpig", K=None, L=None)


def test_a_window_that_does_not_bind_leaves_its_layer_sparse():
    """Every windowed layer was counted as a dense read of min(n, W) keys, though decode_spec makes a
    layer dense only where its window binds: a window longer than the run left the layer sampled, and
    the method's bytes came out as dense attention's."""
    windows = {1: 4096, 2: 4096, 3: 4096}
    assert _bytes("magicpig", layer_windows=windows) == _bytes("magicpig")
    short = _bytes("magicpig", dense_layers=[0, 1], layer_windows={1: 100})  # binding: dense, at most W keys
    assert short["k"] == pytest.approx(_bytes("magicpig", dense_layers=[0, 1])["k"] - 900 * 2 * 8 * 4)


def test_quest_counts_the_rows_of_its_kept_pages():
    """Quest's keys were its budget, though it keeps whole pages (a budget of 4 reads a page of 16)."""
    import jax.numpy as jnp
    import numpy as np

    from magicpig_jax.attention.baselines import quest_mask, quest_rows_read

    rng = np.random.default_rng(0)
    N, page = 100, 16
    q = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((3, 2, N, 8)), jnp.float32)
    lengths = jnp.asarray([100, 96, 7], jnp.int32)
    for budget in (4, 16, 40, 0.05, 0.5, 1.0, 1000):
        rows = np.asarray(quest_rows_read(budget, lengths, page))
        kept = np.asarray(quest_mask(q, k, page, budget, lengths)).sum(-1)  # [B, Hkv, G]: the keys attended
        # exact where the kept pages are whole; a kept partial last page (row 0's keys 96..99) counts whole
        assert (kept <= rows[:, None, None]).all() and (rows[:, None, None] - kept < page).all(), budget
        assert (kept[1] == rows[1]).all(), budget  # 96 keys: whole pages
