"""Method-layer contracts of magicpig_jax.attention (and the host op's drop-in), for users who call
the estimators from their own model.

Padding is inert: NaN or infinity in the K and V rows past a row's length, or in the V rows of
valid keys that no head selects (not sampled, not in the top k, not in a chosen page, never
drawn), leaves every output finite where the clean cache's is, equal to the clean cache's up to
float32 rounding, and equal to a float64 reference. Not bit-equal: with a non-finite value row the
weighted sum is recomputed over the selected rows, a different XLA program, whose kernels may sum
in another order (jax 0.12.1's CPU backend does; 0.12.0's gave the same bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magicpig_jax import lsh
from magicpig_jax.attention import (
    MagicPIGConfig,
    build_lsh_index,
    dense_attention,
    magicpig_attention,
    oracle_sampling_attention,
    quest_attention,
    static_attention,
    topk_attention,
)
from magicpig_jax.attention.baselines import quest_mask, topk_mask
from magicpig_jax.attention.magicpig import sampled_mask_and_log_u
from tests import _np_reference as ref
from tests._jitted import i32

pytestmark = pytest.mark.usefixtures("strict_jax")

B, HQ, HKV, N, D = 2, 4, 2, 64, 8
G = HQ // HKV
LENGTHS = np.array([40, 64])  # row 0: slots 40..63 are padding


def _case(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, HQ, D)).astype(np.float32)
    k = (rng.normal(size=(B, HKV, N, D)) + 0.7 * rng.normal(size=(B, HKV, 1, D))).astype(np.float32)
    v = rng.normal(size=(B, HKV, N, D)).astype(np.float32)
    return q, k, v


def _garbage(x: np.ndarray, rows: np.ndarray) -> jax.Array:
    """``x`` with NaN in the rows where ``rows`` ``[B, Hkv, N]``, and +-inf in every third of them."""
    x = x.copy()
    x[rows] = np.nan
    idx = np.argwhere(rows)[::3]
    x[tuple(idx.T)] = np.inf * np.where(np.arange(len(idx)) % 2, 1, -1)[:, None]
    return jnp.asarray(x)


def _padding() -> np.ndarray:
    return np.broadcast_to(np.arange(N)[None, None, :] >= LENGTHS[:, None, None], (B, HKV, N)).copy()


# float32 rounding of sums of O(1) terms, in whatever order XLA's kernels add them (a few ulp of 1);
# garbage that leaked would be NaN or infinite, far outside it
ROUNDING = 1e-6


def _assert_same(got, clean):
    for g, c in zip(got, clean, strict=True):
        g, c = np.asarray(g), np.asarray(c)
        np.testing.assert_array_equal(np.isfinite(g), np.isfinite(c))
        np.testing.assert_allclose(g, c, rtol=ROUNDING, atol=ROUNDING)  # NaN where NaN, inf where inf


def test_dense_padding_is_inert():
    q, k, v = _case(1)
    pad = _padding()
    clean = dense_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), i32(LENGTHS))
    got = dense_attention(jnp.asarray(q), _garbage(k, pad), _garbage(v, pad), i32(LENGTHS))
    _assert_same(got, clean)
    o64, l64 = ref.dense(q, k, v, LENGTHS)
    np.testing.assert_allclose(np.asarray(got[0]), o64, rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(got[1]), l64, rtol=0, atol=2e-6)


def test_static_attention_padding_and_hashed_range_are_inert():
    # The static set is [0, start) and the tail [end, length): the hashed middle is not its business.
    q, k, v = _case(2)
    start, end = i32([3, 3]), i32([30, 50])
    pos = np.arange(N)[None, None, :]
    unused = np.broadcast_to((pos >= np.asarray(start)[:, None, None]) & (pos < np.asarray(end)[:, None, None])
                             | (pos >= LENGTHS[:, None, None]), (B, HKV, N))
    keep = ~unused[:, :1, :].repeat(HQ, 1)  # [B, Hq, N] for the float64 reference
    o64, l64 = ref.selected(q, k, v, keep)
    for window in (None, 5, 20, 100):
        args = (start, end, i32(LENGTHS))
        clean = static_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), *args, num_sink=3, window=window)
        got = static_attention(jnp.asarray(q), _garbage(k, unused), _garbage(v, unused), *args, num_sink=3,
                               window=window)
        _assert_same(got, clean)
        if window is None or window >= 100:
            np.testing.assert_allclose(np.asarray(got[0]), o64, rtol=0, atol=2e-6)
            np.testing.assert_allclose(np.asarray(got[1]), l64, rtol=0, atol=2e-6)


@pytest.mark.parametrize("budget", [5, 0.25])
def test_topk_unselected_and_padding_are_inert(budget):
    q, k, v = _case(3)
    keep = np.asarray(topk_mask(jnp.asarray(q), jnp.asarray(k), budget, i32(LENGTHS)))  # [B, Hkv, G, N]
    unused_k = _padding()
    unused_v = unused_k | ~keep.any(2)  # V rows no head of the KV head keeps
    assert (unused_v & ~unused_k).any()
    clean = topk_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), budget, i32(LENGTHS))
    got = topk_attention(jnp.asarray(q), _garbage(k, unused_k), _garbage(v, unused_v), budget, i32(LENGTHS))
    _assert_same(got, clean)
    o64, l64 = ref.selected(q, k, v, keep.reshape(B, HQ, N))
    np.testing.assert_allclose(np.asarray(got[0]), o64, rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(got[1]), l64, rtol=0, atol=2e-6)


def test_topk_key_kept_by_one_head_only_is_inert_for_the_others():
    # Per query head: a key kept by head 0 but not head 1 of the same KV head, with a NaN value,
    # gives NaN to head 0 (it attends to it) and leaves head 1 exactly as before.
    q, k, v = _case(4)
    keep = np.asarray(topk_mask(jnp.asarray(q), jnp.asarray(k), 4, i32(LENGTHS)))
    only0 = keep[:, :, 0] & ~keep[:, :, 1]  # [B, Hkv, N]
    b, h, n = np.argwhere(only0)[0]
    bad = np.zeros((B, HKV, N), bool)
    bad[b, h, n] = True
    clean = topk_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 4, i32(LENGTHS))
    out, lse = topk_attention(jnp.asarray(q), jnp.asarray(k), _garbage(v, bad), 4, i32(LENGTHS))
    head0, head1 = h * G, h * G + 1
    assert not np.isfinite(np.asarray(out[b, head0])).any()
    others = np.ones((B, HQ), bool)
    others[b, head0] = False
    assert np.isfinite(np.asarray(out)[others]).all()
    np.testing.assert_allclose(np.asarray(out[b, head1]), np.asarray(clean[0][b, head1]), rtol=ROUNDING,
                               atol=ROUNDING)
    np.testing.assert_allclose(np.asarray(out)[others], np.asarray(clean[0])[others], rtol=ROUNDING, atol=ROUNDING)
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(clean[1]))


def test_quest_unselected_pages_and_padding_are_inert():
    q, k, v = _case(5)
    keep = np.asarray(quest_mask(jnp.asarray(q), jnp.asarray(k), 8, 16, i32(LENGTHS)))
    unused_k = _padding()
    unused_v = unused_k | ~keep.any(2)
    assert (unused_v & ~unused_k).any()
    clean = quest_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 8, 16, i32(LENGTHS))
    got = quest_attention(jnp.asarray(q), _garbage(k, unused_k), _garbage(v, unused_v), 8, 16, i32(LENGTHS))
    _assert_same(got, clean)
    o64, l64 = ref.selected(q, k, v, ref.quest_keep(q, k, 8, [16, 16], LENGTHS))
    np.testing.assert_allclose(np.asarray(got[0]), o64, rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(got[1]), l64, rtol=0, atol=2e-6)


def test_oracle_padding_and_keys_never_drawn_are_inert():
    q, k, v = _case(6)
    # keys with logit -200 for every query head of their KV head: softmax weight 0 in float32
    # (exp(-200) underflows), so never drawn
    far = np.zeros((B, HKV, N), bool)
    far[:, :, [3, 17, 29]] = True
    for b in range(B):
        for h in range(HKV):
            qg = q[b, h * G : (h + 1) * G].astype(np.float64)  # [G, D]
            d = np.linalg.lstsq(qg, -np.ones(G), rcond=None)[0]  # qg @ d = -1
            k[b, h, far[b, h]] = (200 * np.sqrt(D) * d).astype(np.float32)
    unused_k = _padding()
    unused_v = unused_k | far
    key = jax.random.key(7)
    clean = oracle_sampling_attention(key, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 32, i32(LENGTHS))
    got = oracle_sampling_attention(key, jnp.asarray(q), _garbage(k, unused_k), _garbage(v, unused_v), 32,
                                    i32(LENGTHS))
    _assert_same(got, clean)
    _, l64 = ref.dense(q, k, v, LENGTHS)
    np.testing.assert_allclose(np.asarray(got[1]), l64, rtol=0, atol=2e-6)


def _magicpig_case(seed):
    q, k, v = _case(seed)
    cfg = MagicPIGConfig(K=3, L=6, num_sink=2, num_local=4)
    proj = lsh.simhash_projections(jax.random.key(seed), D, cfg.K, cfg.L)
    index = build_lsh_index(jnp.asarray(k), proj, cfg, i32(LENGTHS))
    sampled, _, _ = sampled_mask_and_log_u(jnp.asarray(q), jnp.asarray(k), index, cfg, i32(LENGTHS))
    sampled = np.asarray(sampled)  # [B, Hkv, G, N]
    start, end = np.asarray(index.start), np.asarray(index.end)
    pos = np.arange(N)[None, None, :]
    hashed = np.broadcast_to((pos >= start[:, None, None]) & (pos < end[:, None, None]), (B, HKV, N))
    unused_v = _padding() | (hashed & ~sampled.any(2))
    assert (hashed & ~sampled.any(2)).any() and sampled.any()
    return cfg, proj, index, q, k, v, unused_v


def test_magicpig_unsampled_and_padding_are_inert():
    cfg, proj, index, q, k, v, unused_v = _magicpig_case(8)
    unused_k = _padding()
    clean = magicpig_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), index, cfg, i32(LENGTHS))
    kg = _garbage(k, unused_k)
    # the index of the garbage cache is the clean one (padding is outside the hashed range)
    index_g = build_lsh_index(kg, proj, cfg, i32(LENGTHS))
    np.testing.assert_array_equal(np.asarray(index_g.mean), np.asarray(index.mean))
    got = magicpig_attention(jnp.asarray(q), kg, _garbage(v, unused_v), index_g, cfg, i32(LENGTHS))
    _assert_same(got, clean)
    qc = np.asarray(lsh.simhash_codes(jnp.asarray(q), proj, cfg.K, cfg.L))
    o64, l64, n64 = ref.magicpig(q, k, v, np.asarray(index.codes), qc, cfg.K, cfg.L, cfg.num_sink, cfg.num_local,
                                 LENGTHS, LENGTHS)
    np.testing.assert_array_equal(np.asarray(got[2]), n64)
    np.testing.assert_allclose(np.asarray(got[0]), o64, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), l64, rtol=0, atol=1e-5)


@pytest.mark.parametrize("static_window", [None, 0, 3])
def test_host_magicpig_unsampled_and_padding_are_inert(static_window):
    from magicpig_jax import host

    cfg, proj, _, q, k, v, unused_v = _magicpig_case(9)
    unused_k = _padding()
    hidx = host.host_build_index(jnp.asarray(k), proj, cfg, i32(LENGTHS))
    kw = {} if static_window is None else {"static_window": static_window}
    clean = host.host_magicpig_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), hidx, cfg, i32(LENGTHS),
                                         **kw)
    got = host.host_magicpig_attention(jnp.asarray(q), _garbage(k, unused_k), _garbage(v, unused_v), hidx, cfg,
                                       i32(LENGTHS), **kw)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(clean[2]))
    assert np.isfinite(np.asarray(got[0])).all()
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(clean[0]), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(clean[1]), rtol=0, atol=1e-6)


# Every parameter a public function validates has an effect a test observes.


@pytest.mark.parametrize("window", [None, 0, 7, 100])
def test_static_attention_num_sink_bounds_the_sinks_with_and_without_a_window(window):
    # num_sink is validated for every call and read by both paths: with start beyond it, the sinks
    # are the first num_sink positions, with or without a window (it was unused without one).
    q, k, v = _case(10)
    start, end = i32([6, 6]), i32([30, 50])
    out, lse = static_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), start, end, i32(LENGTHS), num_sink=3,
                                window=window)
    pos = np.arange(N)[None, None, :]
    tail_from = np.asarray(end) if window is None else np.maximum(np.asarray(end), LENGTHS - window)
    keep = (pos < 3) | ((pos >= tail_from[:, None, None]) & (pos < LENGTHS[:, None, None]))
    o64, l64 = ref.selected(q, k, v, np.broadcast_to(keep, (B, HQ, N)))
    np.testing.assert_allclose(np.asarray(out), o64, rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), l64, rtol=0, atol=2e-6)


@pytest.mark.parametrize(("B", "Hq"), [(0, 2), (1, 0), (0, 0)])
def test_empty_batches_and_head_sets_give_empty_results(B, Hq):
    """No rows or no query heads: empty outputs of the documented shapes (a ZeroDivisionError in a
    reshape before), as the host ops give."""
    D = 4
    q, k = jnp.ones((B, Hq, D)), jnp.ones((B, 1, 50, D))
    cfg = MagicPIGConfig(K=4, L=10, num_sink=2, num_local=4)
    proj = lsh.simhash_projections(jax.random.key(0), D, cfg.K, cfg.L)
    results = [dense_attention(q, k, k), magicpig_attention(q, k, k, build_lsh_index(k, proj, cfg), cfg),
               topk_attention(q, k, k, 8), quest_attention(q, k, k, 4, 8),
               oracle_sampling_attention(jax.random.key(1), q, k, k, 8)]
    for out, lse, *_ in results:
        assert out.shape == (B, Hq, D) and lse.shape == (B, Hq)


def test_numpy_scalar_budgets_count_as_ints_and_floats():
    """np.int64(5) is a token count and np.float32(0.5) a fraction, as 5 and 0.5 are (they were
    refused as "not an int")."""
    q, k = jnp.ones((1, 2, 4)), jnp.asarray(np.random.default_rng(0).standard_normal((1, 1, 50, 4)), jnp.float32)
    for budget, plain in ((np.int64(5), 5), (np.float32(0.5), 0.5)):
        np.testing.assert_array_equal(np.asarray(topk_attention(q, k, k, budget)[0]),
                                      np.asarray(topk_attention(q, k, k, plain)[0]))
    with pytest.raises(TypeError, match="budget"):
        topk_attention(q, k, k, np.bool_(True))


def test_an_index_refuses_a_config_with_another_static_set():
    """magicpig_attention and hybrid_attention took the static set from the index and ignored the
    config's num_sink / num_local: a config that differed from the build's gave the build's answer."""
    import dataclasses

    from magicpig_jax import lsh
    from magicpig_jax.attention import HybridConfig, LSHIndex, build_lsh_index, hybrid_attention, magicpig_attention

    r = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(r[0], (1, 2, 8)), jax.random.normal(r[1], (1, 1, 64, 8)),
               jax.random.normal(r[2], (1, 1, 64, 8)))
    built = MagicPIGConfig(K=4, L=8, num_sink=4, num_local=16)
    index = build_lsh_index(k, lsh.simhash_projections(jax.random.key(0), 8, 4, 8), built)
    assert (index.num_sink, index.num_local) == (4, 16)
    assert jax.tree.leaves(index)[0].shape == index.codes.shape  # static metadata, not leaves
    for asked, name in ((dataclasses.replace(built, num_sink=64), "num_sink"),
                        (dataclasses.replace(built, num_local=8), "num_local")):
        with pytest.raises(ValueError, match=f"built with {name}="):
            magicpig_attention(q, k, v, index, asked)
    with pytest.raises(ValueError, match="built with num_local=16 but config has num_local=8"):
        hybrid_attention(q, k, v, index, HybridConfig(K=4, L=8, num_sink=4, num_local=8, heavy=4))
    magicpig_attention(q, k, v, index, built)  # the build's own config is accepted
    by_hand = LSHIndex(codes=index.codes, mean=index.mean, start=index.start, end=index.end,
                       projections=index.projections)  # nothing recorded: nothing to check
    magicpig_attention(q, k, v, by_hand, dataclasses.replace(built, num_sink=64))


def test_collision_probability_holds_at_extreme_norms():
    """|q||k| was formed from float32 norms: parallel vectors of norm 4e-20 read as zero (p = 1/2,
    the true p is 1) and of norm 4e19 overflowed to NaN."""
    from magicpig_jax import lsh

    x = jnp.array([1.0, 2.0, -3.0, 0.5])
    for scale in (4e-20, 1.0, 4e19):
        assert float(lsh.collision_probability(scale * x, 2 * scale * x)) == pytest.approx(1.0, abs=1e-3)
        assert float(lsh.collision_probability(scale * x, -scale * x)) == pytest.approx(0.0, abs=1e-3)
    assert float(lsh.collision_probability(x, jnp.zeros(4))) == 0.5


@pytest.mark.parametrize("window", [None, 3])
def test_static_attention_takes_a_num_sink_past_int32(window):
    """num_sink = 2**31 raised OverflowError naming an internal argument 'y'; sinks are capped at N."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((1, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 6, 8)), jnp.float32)
    args = (q, k, k, i32([2]), i32([3]), i32([5]))
    want = static_attention(*args, num_sink=6, window=window)
    for ns in (2**31, 2**40):
        got = static_attention(*args, num_sink=ns, window=window)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
